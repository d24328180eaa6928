"""``envoy.service.ext_proc.v3.ExternalProcessor/Process``: the endpoint picker protocol.

One ext_proc stream per HTTP request (Gateway API Inference Extension, proposal 004):

- request headers, then the body. In ``FULL_DUPLEX_STREAMED`` mode (the mode the proposal
  requires; bodies of any size) the headers answer is held until the body is complete,
  then the picker sends the headers answer and the whole body back in one streamed body
  answer. In ``BUFFERED`` mode the headers are answered at once and the pick rides on the
  body answer (header mutations are allowed there). A request without a body (or body
  mode ``NONE``) is picked on its headers.
- the pick: the body's prompt and ``max_tokens`` give the KV length; the decode balancer
  places it on a decode GPU among the allowed ones (those with a serving address, within
  the request's subset hint ``filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`` when present). The answer sets the
  ``x-gateway-destination-endpoint`` header (primary, then fallbacks, comma-separated)
  and the same value in dynamic metadata under ``envoy.lb``, and clears the route cache.
- no allowed live endpoint: immediate 503. A bound sheds the request (every allowed GPU
  full, the placement table or ``gateway.max_in_flight`` at its bound): immediate 429 with
  ``retry-after``. A body over ``gateway.max_body_bytes``: 413; KV estimate above the
  decode table's bound: 400.
- the response path: the endpoint that served it is read from
  ``metadata_context["envoy.lb"]["x-gateway-destination-endpoint-served"]`` (or the
  ``upstream.address`` attribute); the placement is released when the response ends
  (end of stream on headers, body or trailers) or, at the latest, when the ext_proc stream
  closes (client gone, upstream reset, Envoy done). In the lean mode (request headers,
  a BUFFERED body, nothing from the response: two messages per request) the release is
  the stream's close, which Envoy sends at the end of the HTTP stream.
- one request per stream (:class:`_Stream`, a method per phase): at most one pick; a
  message out of order or a second end of stream is an immediate 400 that releases what
  the stream held. Bounds: ``gateway.max_streams`` and ``gateway.max_pending_bytes``
  (429), ``gateway.max_body_ms`` (503), JSON nesting (400). See docs/gateway-limits.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import structlog
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from fulcrum.config.gateway import GatewaySettings
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass
from fulcrum.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from fulcrum.gateway import metrics as gm
from fulcrum.gateway.adapter import DecodeAdapter, NoEligibleEndpoint, Placement
from fulcrum.gateway.body import BodyTooDeep, RequestShape, TokenCounter, parse_body
from fulcrum.gateway.cache_pick import CachePicker
from fulcrum.gateway.prefill import PrefillProxy
from fulcrum.gateway.tenancy import classify, header_roles
from fulcrum.service.streams import drain
from fulcrum.service.tenants import Tenancy

log = structlog.get_logger(__name__)

SERVICE: str = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name

DEST_HEADER = "x-gateway-destination-endpoint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
PREFILLER_HEADER = "x-prefiller-host-port"

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_BODY_NONE = processing_mode_pb2.ProcessingMode.NONE
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

#: Bodies larger than this are parsed in a worker thread (JSON parsing runs at roughly
#: 100-300 MB/s: 256 KiB is about 1-3 ms on the loop), bytes.
OFFLOAD_BYTES = 256 * 1024

#: Bound of the cached destination answers, here and in the unary Check (distinct
#: primary + fallbacks values x 2 phases).
ANSWER_CACHE_MAX = 8192

_STATUS = {
    400: http_status_pb2.BadRequest,
    413: http_status_pb2.PayloadTooLarge,
    429: http_status_pb2.TooManyRequests,
    503: http_status_pb2.ServiceUnavailable,
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """An immediate response instead of a destination."""

    code: int
    outcome: str
    message: str
    retry_after_s: int = 0


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _header_value(h: base_pb2.HeaderValue) -> str:
    return str(h.raw_value.decode("latin-1") if h.raw_value else h.value)


def _struct_strings(value: struct_pb2.Value) -> list[str]:
    """A list of strings, or a comma-separated string, as a list of ``ip:port``."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        out: list[str] = []
        for v in value.list_value.values:
            if v.WhichOneof("kind") == "string_value":
                out.extend(s.strip() for s in v.string_value.split(",") if s.strip())
        return out
    if kind == "string_value":
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return []


def subset_hint(req: ep.ProcessingRequest, namespace: str) -> list[str] | None:
    """The subset hint of a request (None when absent; possibly empty)."""
    return subset_in(req.metadata_context, namespace)


def subset_in(metadata: base_pb2.Metadata, namespace: str) -> list[str] | None:
    """The subset hint in a message's metadata context (ext_proc's or ext_authz's)."""
    md = metadata.filter_metadata
    if namespace not in md:
        return None
    fields = md[namespace].fields
    if SUBSET_KEY not in fields:
        return None
    return _struct_strings(fields[SUBSET_KEY])


def served_endpoint(req: ep.ProcessingRequest, namespace: str) -> str:
    """The endpoint that served the response ('' when the data plane does not say)."""
    md = req.metadata_context.filter_metadata
    if namespace in md and SERVED_KEY in md[namespace].fields:
        got = _struct_strings(md[namespace].fields[SERVED_KEY])
        if got:
            return got[0]
    for attrs in req.attributes.values():
        v = attrs.fields.get("upstream.address")
        if v is not None and v.WhichOneof("kind") == "string_value":
            return str(v.string_value)
    return ""


class Picker:
    """The picking and the bookkeeping shared by every stream (event loop only)."""

    def __init__(
        self,
        settings: GatewaySettings,
        adapter: DecodeAdapter,
        clock: Callable[[], int],
        max_request_kv: Callable[[], int],
        counter: TokenCounter | None = None,
        prefill: PrefillProxy | None = None,
    ) -> None:
        self.settings = settings
        #: P/D: the prefill side (None when the pool has no prefill engine).
        self.prefill = prefill
        self.adapter = adapter
        self._clock = clock
        self._max_request_kv = max_request_kv
        self.counter = counter
        self._ids = itertools.count(1)
        #: request id -> the placement a stream holds (one at most per stream).
        self._held: dict[str, Placement] = {}
        self.streams = 0
        #: Request body bytes held by streams still assembling one, bytes.
        self.pending_bytes = 0
        #: Picks, releases and pick times (plain counts; the scrape reads a snapshot).
        self.counts = counts = gm.PickCounts()
        gm.PICK_FIGURES.set_source(counts.publisher)
        self._answers: dict[tuple[str, str, str], ep.ProcessingResponse] = {}
        #: Test hook: called with (request_id, Placement) after each pick.
        self.pick_hooks: list[Callable[[str, Placement], None]] = []
        #: Test hook: called with (request_id, reason) after each release.
        self.release_hooks: list[Callable[[str, str], None]] = []
        #: Cache-aware picks (gateway.cache.enabled, engines without a prefill pool).
        self.cache: CachePicker | None = None
        self.tenancy: Tenancy | None = None  # the daemon's tenant table (gateway/server)
        self.tenancy_headers = _tenancy_headers(settings)
        #: The body deadlines of the streams waiting for a message of their request.
        self.body_watch = BodyWatch()
        # The gauges read two ints when scraped (not set on every request).
        me = weakref.ref(self)
        gm.IN_FLIGHT.set_function(lambda: _read(me, lambda p: p.in_flight))
        gm.STREAMS.set_function(lambda: _read(me, lambda p: p.streams))
        if settings.cache.enabled and prefill is None:
            kv = max((e.max_kv_tokens for e in settings.pool.decode), default=0)
            cache = CachePicker(settings.cache, settings.chars_per_token, adapter, kv)
            self.cache = cache
            self.release_hooks.append(lambda rid, why: cache.released(rid, why, clock()))

    @property
    def in_flight(self) -> int:
        """Requests holding a placement: derived from the held placements."""
        return len(self._held)

    def apply_settings(self, settings: GatewaySettings) -> None:
        """Reload: every key but the restart-only ones (enabled, host, ports, pool)."""
        self.settings = settings
        self.tenancy_headers = _tenancy_headers(settings)
        self._answers.clear()  # the metadata namespace may have changed

    def _count(self, outcome: str) -> None:
        self.counts.pick(self.adapter.policy_name, outcome)

    def parse(self, body: bytes, path: str) -> RequestShape:
        """The body's prompt and output estimate (pure; may run in a worker thread)."""
        s = self.settings
        return parse_body(
            body,
            path,
            s.chars_per_token,
            s.default_max_tokens,
            self.counter,
            with_text=self.cache is not None,
        )

    def too_large(self) -> Refusal:
        """413 (counted): a body over ``gateway.max_body_bytes``."""
        n = self.settings.max_body_bytes
        self._count("too_large")
        return Refusal(413, "too_large", f"request body over {n} bytes (gateway.max_body_bytes)")

    def _full(self) -> Refusal | None:
        """429 (counted) when ``gateway.max_in_flight`` requests hold a placement."""
        s = self.settings
        if self.in_flight < s.max_in_flight:
            return None
        self._count("shed")
        return Refusal(
            429, "shed", f"gateway: {s.max_in_flight} requests in flight", s.retry_after_s
        )

    def pick(
        self,
        body: bytes,
        path: str,
        subset: list[str] | None,
        shape: RequestShape | None = None,
        cls: RequestClass = DEFAULT_CLASS,
    ) -> Placement | Refusal:
        """Choose the destination of one request (placement held until :meth:`release`).
        ``shape``: the body already parsed (off the loop), else it is parsed here."""
        t0 = time.perf_counter()
        s = self.settings
        full = self._full()
        if full is not None:
            return full
        if shape is None:
            shape = self.parse(body, path)
        kv = shape.kv_tokens
        limit = self._max_request_kv()
        if kv > limit:
            self._count("bad_request")
            return Refusal(
                400,
                "bad_request",
                f"prompt + max_tokens: estimated {kv} tokens, must be <= {limit} "
                "(decode.max_request_kv_tokens)",
            )
        request_id = f"gw-{next(self._ids)}"
        now = self._clock()
        choice = None if self.cache is None else self.cache.choose(self.adapter, shape, subset, now)
        pin = None if choice is None else choice.slot
        try:
            placement = self.adapter.place(
                request_id, kv, now, subset=subset, fallbacks=s.fallbacks, pin=pin, cls=cls
            )
        except NoEligibleEndpoint as err:
            self._count("no_endpoint")
            return Refusal(503, "no_endpoint", f"gateway: {err}")
        except ResourceExhausted as err:
            never = _never_fits(self.adapter, kv, subset)
            if never is not None:
                self._count("bad_request")
                return Refusal(400, "bad_request", never)
            self._count("shed")
            retry = max(s.retry_after_s, -(-err.retry_after_ms // 1000))
            return Refusal(429, "shed", err.message, retry)
        except (InvalidArgument, AlreadyExists) as err:
            self._count("bad_request")
            return Refusal(400, "bad_request", err.message)
        if self.prefill is not None:
            placement = placement._replace(prompt_tokens=shape.prompt_tokens)
        if choice is not None and self.cache is not None:
            self.cache.placed(request_id, choice, shape.prompt_tokens, now, shape.stream)
        self._held[request_id] = placement
        self._count("picked")
        self.counts.timed(time.perf_counter() - t0)
        for hook in self.pick_hooks:
            hook(request_id, placement)
        return placement

    def _offloaded(self, body: bytes) -> bool:
        """The body is parsed (and tokenized) in a worker thread: over ``OFFLOAD_BYTES``,
        or any body when a tokenizer is configured."""
        return len(body) > OFFLOAD_BYTES or (self.counter is not None and bool(body))

    def answers_at_once(self, body: bytes) -> bool:
        """:meth:`pick_full` of ``body`` would not wait (no worker thread, no prefill
        placement), so :meth:`pick` alone answers it, on the caller's own callback."""
        return self.prefill is None and not self._offloaded(body)

    async def pick_full(
        self, body: bytes, path: str, subset: list[str] | None, cls: RequestClass = DEFAULT_CLASS
    ) -> Placement | Refusal:
        """:meth:`pick`, then (P/D, a request with a prompt) :meth:`pick_prefill`. A body
        over ``OFFLOAD_BYTES`` is parsed (and tokenized) in a worker thread, so that the
        event loop never spends more than a few ms on one request."""
        shape = None
        if self._offloaded(body):
            loop = asyncio.get_running_loop()
            shape = await loop.run_in_executor(None, self.parse, body, path)
        out = self.pick(body, path, subset, shape, cls)
        if self.prefill is not None and isinstance(out, Placement) and out.prompt_tokens > 0:
            return await self.pick_prefill(out, cls)
        return out

    async def pick_prefill(
        self, placement: Placement, cls: RequestClass = DEFAULT_CLASS
    ) -> Placement | Refusal:
        """P/D: choose the prefill engine and rank with the prefill balancer (waits for a
        pull made on an engine's behalf). On a refusal the decode placement is released."""
        assert self.prefill is not None
        s = self.settings
        try:
            prefiller = await self.prefill.place(
                placement.request_id, placement.prompt_tokens, cls)
        except asyncio.CancelledError:  # the stream went away while waiting for a pull
            self.release(placement, "stream_closed")
            raise
        except (DeadlineExceeded, ResourceExhausted) as err:
            self.release(placement, "stream_closed")
            self._count("shed")
            return Refusal(429, "shed", err.message, s.retry_after_s)
        except Unavailable as err:
            self.release(placement, "stream_closed")
            self._count("no_endpoint")
            return Refusal(503, "no_endpoint", err.message)
        except InvalidArgument as err:
            self.release(placement, "stream_closed")
            self._count("bad_request")
            return Refusal(400, "bad_request", f"prefill {err.message}")
        return placement._replace(prefiller=prefiller)

    def response_started(self, placement: Placement) -> None:
        """Response headers came back: the request's prefill is done."""
        if self.prefill is not None and placement.prefiller:
            self.prefill.finished(placement.request_id)

    def first_chunk(self, placement: Placement, ttft_ns: float | None = None) -> None:
        """The response's first body chunk passed (a streamed response's first token);
        ``ttft_ns``: its time as Envoy's access log measured it (ns; None: now)."""
        if self.cache is not None:
            self.cache.first_token(placement.request_id, self._clock(), ttft_ns)

    def release(self, placement: Placement, reason: str) -> None:
        """End a request's placement (once per pick)."""
        if self.prefill is not None:
            self.prefill.finished(placement.request_id)
        self._held.pop(placement.request_id, None)
        held = self.adapter.release(placement.request_id, self._clock())
        self.counts.released(reason if held else "not_held")
        for hook in self.release_hooks:
            hook(placement.request_id, reason if held else "not_held")

    # -- answers -------------------------------------------------------------------------

    def destination(self, placement: Placement, phase: str) -> ep.ProcessingResponse:
        """The answer of ``phase`` ("request_headers" or "request_body") carrying the
        destination: header mutation with the route cache cleared, and the same value in
        dynamic metadata. Answers are immutable once built, so they are cached per value
        (bounded: at most ``ANSWER_CACHE_MAX`` entries, then the cache starts over)."""
        value = destination_value(placement)
        key = (value, phase, placement.prefiller)
        cached = self._answers.get(key)
        if cached is not None:
            return cached
        set_headers = [_header(DEST_HEADER, value)]
        if placement.prefiller:
            set_headers.append(_header(PREFILLER_HEADER, placement.prefiller))
        common = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=set_headers),
            clear_route_cache=True,
        )
        md = struct_pb2.Struct()
        md.fields[self.settings.metadata_namespace].struct_value.fields[
            DEST_HEADER
        ].string_value = value
        if phase == "request_headers":
            answer = ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=md
            )
        else:
            answer = ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=common), dynamic_metadata=md
            )
        if len(self._answers) >= ANSWER_CACHE_MAX:
            self._answers.clear()
        self._answers[key] = answer
        return answer

    @staticmethod
    def immediate(refusal: Refusal) -> ep.ProcessingResponse:
        count_refusal(refusal)
        headers = [_header(k, v) for k, v in refusal_headers(refusal)]
        return ep.ProcessingResponse(
            immediate_response=ep.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=_STATUS[refusal.code]),
                headers=ep.HeaderMutation(set_headers=headers),
                body=refusal_body(refusal),
                details=f"fulcrum_{refusal.outcome}",
            )
        )


def refusal_headers(refusal: Refusal) -> list[tuple[str, str]]:
    """The response headers of a refusal in every Envoy mode: JSON, and ``retry-after``
    (s) on a 429."""
    headers = [("content-type", "application/json")]
    if refusal.code == 429:
        headers.append(("retry-after", str(refusal.retry_after_s)))
    return headers


def count_refusal(refusal: Refusal, refused: bool = False) -> None:
    """Count a refusal the picker answers itself (``refused``: one also counted as
    refused before any pick, e.g. too many picks under way)."""
    if refused:
        gm.REFUSED.labels(refusal.outcome).inc()
    gm.IMMEDIATE.labels(str(refusal.code)).inc()


def destination_value(placement: Placement) -> str:
    """The ``x-gateway-destination-endpoint`` value: the primary, then the fallbacks."""
    if not placement.fallbacks:
        return placement.address
    return ",".join((placement.address, *placement.fallbacks))


def refusal_body(refusal: Refusal) -> bytes:
    """The JSON error body of a refusal (OpenAI's error shape)."""
    return (
        '{"error":{"message":' + _json_str(refusal.message) + ',"type":"'
        + refusal.outcome + '","code":' + str(refusal.code) + "}}"
    ).encode()


def _tenancy_headers(settings: GatewaySettings) -> frozenset[str]:
    return frozenset(header_roles(settings.tenancy))


def _read(ref: weakref.ReferenceType[Picker], figure: Callable[[Picker], int]) -> float:
    """A gauge's value from a picker held weakly (0 once it is gone)."""
    picker = ref()
    return 0.0 if picker is None else float(figure(picker))


def _json_str(s: str) -> str:
    return json.dumps(s)


def _streamed_request_body(body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: the request body handed back to Envoy in one piece."""
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(
                body_mutation=ep.BodyMutation(
                    streamed_response=ep.StreamedBodyResponse(
                        body=body, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


_EMPTY_REQ_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
_EMPTY_RESP_HEADERS = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
_EMPTY_REQ_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())
_EMPTY_RESP_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse())
_EMPTY_REQ_TRAILERS = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
_EMPTY_RESP_TRAILERS = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


#: Phases of one stream: waiting for the request, reading its body, picked (waiting for
#: the response), reading the response, done (anything more is out of order).
_START, _BODY, _PICKED, _RESPONSE, _DONE = range(5)

Out = tuple[ep.ProcessingResponse, ...]


class _Refused(Exception):
    """Ends a stream with an immediate response."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


def _refuse(reason: str, code: int, message: str, retry_after_s: int = 0) -> _Refused:
    gm.REFUSED.labels(reason).inc()
    return _Refused(Refusal(code, reason, message, retry_after_s))


def _scan(
    headers: Iterable[base_pb2.HeaderValue], names: frozenset[str]
) -> tuple[str, list[base_pb2.HeaderValue]]:
    """One pass over the request headers: the ``:path`` and the headers named in
    ``names`` (the tenancy headers, lower case)."""
    path = ""
    wanted: list[base_pb2.HeaderValue] = []
    for h in headers:
        key = h.key
        if key == ":path":
            path = _header_value(h)
        elif key.lower() in names:
            wanted.append(h)
    return path, wanted


class BodyWatch:
    """The body deadlines of the streams blocked in a read of their request (event loop
    only): one timer for all of them, armed for the earliest deadline, instead of one
    timer per stream. A stream registers while it waits for a message and leaves when
    the message comes; when the timer fires, every registered stream past its deadline
    is expired (its read cancelled), and the timer is armed again for the earliest
    deadline left. A read that does not block costs two set operations."""

    __slots__ = ("_at", "_reading", "_timer")

    def __init__(self) -> None:
        self._reading: set[_Stream] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf  # when the timer fires (loop time, s)

    def __len__(self) -> int:
        return len(self._reading)

    def enter(self, stream: _Stream) -> None:
        """``stream`` waits for a message (until :meth:`leave`)."""
        self._reading.add(stream)
        if stream.deadline < self._at:
            if self._timer is not None:
                self._timer.cancel()
            self._at = stream.deadline
            self._timer = asyncio.get_running_loop().call_at(stream.deadline, self._fire)

    def leave(self, stream: _Stream) -> None:
        self._reading.discard(stream)

    def _fire(self) -> None:
        self._timer, self._at = None, math.inf
        # A loop may run a timer up to its clock resolution early: a stream due within
        # 1 ms counts as due (else the timer would be armed again for the same instant).
        now = asyncio.get_running_loop().time() + 0.001
        due = [s for s in self._reading if s.deadline <= now]
        for s in due:
            self._reading.discard(s)
            s.expire()
        if self._reading:
            first = min(s.deadline for s in self._reading)
            self._at = first
            self._timer = asyncio.get_running_loop().call_at(first, self._fire)


class _Stream:
    """One ext_proc stream (one HTTP request): its phase, its body so far and its one pick.
    A method per phase returns the answers to send; :class:`_Refused` ends the stream."""

    __slots__ = (
        "_cancelling", "_chunks", "_duplex", "_expired", "_first", "_pending",
        "_pending_headers", "_picker", "_resp_duplex", "_settings", "_task", "_watch",
        "cls", "deadline", "path", "phase", "placement", "subset",
    )

    def __init__(self, picker: Picker, now: float) -> None:
        self._picker = picker
        self._settings = s = picker.settings
        self._watch: BodyWatch = picker.body_watch
        #: Loop time (s) by which the request must be complete (``max_body_ms``).
        self.deadline = now + s.max_body_ms / 1000
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._expired = False
        self._duplex = self._resp_duplex = self._pending_headers = False
        self._first = True  # no response body chunk seen yet
        self._chunks: list[bytes] = []
        self._pending = 0  # body bytes counted in picker.pending_bytes
        self.phase = _START
        self.placement: Placement | None = None
        self.path = ""
        self.subset: list[str] | None = None
        self.cls = DEFAULT_CLASS  # from the request headers (issue 23)

    async def next(self, it: AsyncIterator[ep.ProcessingRequest]) -> ep.ProcessingRequest:
        """The next message; while the request is incomplete, within ``max_body_ms`` of
        the stream's opening (else 503). StopAsyncIteration at the end of the stream.
        A read past the deadline refuses at once; a read that blocks is watched by the
        picker's :class:`BodyWatch`, which cancels it at the deadline."""
        if self.phase > _BODY:
            return await anext(it)
        if self._expired or asyncio.get_running_loop().time() >= self.deadline:
            raise self._late()
        if self._task is None:
            self._task = task = asyncio.current_task()
            self._cancelling = task.cancelling() if task is not None else 0
        watch = self._watch
        watch.enter(self)
        try:
            return await anext(it)
        except asyncio.CancelledError:
            task = self._task
            if self._expired and task is not None and task.uncancel() <= self._cancelling:
                raise self._late() from None
            raise
        finally:
            watch.leave(self)

    def expire(self) -> None:
        """The deadline passed while the stream waited for a message: cancel that read
        (:meth:`next` turns the cancellation into the 503)."""
        self._expired = True
        if self._task is not None:
            self._task.cancel()

    def _late(self) -> _Refused:
        ms = self._settings.max_body_ms
        return _refuse(
            "body_timeout", 503, f"request not complete within {ms} ms (gateway.max_body_ms)"
        )

    async def handle(self, req: ep.ProcessingRequest) -> Out:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self.request_headers(req)
        if kind == "request_body":
            return await self.request_body(req)
        if kind == "request_trailers":
            return await self.request_trailers()
        if kind in ("response_headers", "response_body", "response_trailers"):
            return self.response(req, kind)
        raise self._out_of_order(str(kind))

    def _out_of_order(self, kind: str) -> _Refused:
        phases = ("start", "request body", "picked", "response", "done")
        return _refuse(
            "out_of_order", 400, f"ext_proc: {kind} out of order (stream {phases[self.phase]}; "
            "one request per stream, one end of stream per direction)"
        )

    def _begin(self, req: ep.ProcessingRequest) -> bool:
        """The first request message: protocol and subset hint. True if body mode NONE."""
        self.subset = subset_hint(req, self._settings.subset_namespace)
        if not req.HasField("protocol_config"):
            return False
        pc = req.protocol_config
        self._duplex = pc.request_body_mode == _FULL_DUPLEX
        self._resp_duplex = pc.response_body_mode == _FULL_DUPLEX
        return bool(pc.request_body_mode == _BODY_NONE)

    # -- request phases ----------------------------------------------------------------

    async def request_headers(self, req: ep.ProcessingRequest) -> Out:
        if self.phase != _START:
            raise self._out_of_order("request_headers")
        body_none = self._begin(req)
        p = self._picker
        self.path, wanted = _scan(req.request_headers.headers.headers, p.tenancy_headers)
        self.cls = classify(p.tenancy, p.settings.tenancy, wanted)
        if req.request_headers.end_of_stream or body_none:
            return (self._picker.destination(await self._pick(b""), "request_headers"),)
        self.phase = _BODY
        if self._duplex:
            self._pending_headers = True  # answered once the body is complete
            return ()
        return (_EMPTY_REQ_HEADERS,)

    async def request_body(self, req: ep.ProcessingRequest) -> Out:
        if self.phase == _START:  # request headers skipped (processing_mode SKIP)
            self._begin(req)
            self.phase = _BODY
        elif self.phase != _BODY:
            raise self._out_of_order("request_body")
        b = req.request_body
        if b.body:
            self._add(b.body)
        if not b.end_of_stream:
            return () if self._duplex else (_EMPTY_REQ_BODY,)
        return await self._body_done(eos=True)

    async def request_trailers(self) -> Out:
        if self.phase != _BODY:
            raise self._out_of_order("request_trailers")
        # A request with trailers: its body ended without end_of_stream.
        return (*await self._body_done(eos=False), _EMPTY_REQ_TRAILERS)

    def _add(self, chunk: bytes) -> None:
        s, picker = self._settings, self._picker
        if self._pending + len(chunk) > s.max_body_bytes:
            raise _Refused(picker.too_large())
        if picker.pending_bytes + len(chunk) > s.max_pending_bytes:
            raise _refuse(
                "pending_bytes", 429, f"gateway: {s.max_pending_bytes} body bytes pending "
                "(gateway.max_pending_bytes)", s.retry_after_s,
            )
        self._chunks.append(chunk)
        self._pending += len(chunk)
        picker.pending_bytes += len(chunk)

    def close(self) -> None:
        """The stream ended: give back its pending bytes and its placement."""
        self._picker.pending_bytes -= self._pending
        self._pending = 0
        self._chunks = []
        if self.placement is not None:
            self._picker.release(self.placement, "stream_closed")
            self.placement = None

    async def _body_done(self, eos: bool) -> Out:
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._picker.pending_bytes -= self._pending
        self._pending = 0
        placement = await self._pick(body)
        if not self._duplex:
            return (self._picker.destination(placement, "request_body"),)
        head: Out = ()
        if self._pending_headers:
            self._pending_headers = False
            head = (self._picker.destination(placement, "request_headers"),)
        return (*head, _streamed_request_body(body, eos))

    async def _pick(self, body: bytes) -> Placement:
        """The one pick of the stream (or the refusal that ends it)."""
        try:
            out = await self._picker.pick_full(body, self.path, self.subset, self.cls)
        except BodyTooDeep as err:
            raise _refuse("too_deep", 400, str(err)) from None
        if isinstance(out, Refusal):
            raise _Refused(out)
        self.placement = out
        self.phase = _PICKED
        return out

    # -- response phases ---------------------------------------------------------------

    def response(self, req: ep.ProcessingRequest, kind: str) -> Out:
        """Response messages: after the pick, or Envoy's own local reply to a request
        still being read (413 over its buffer limit) with nothing picked."""
        placement = self.placement
        if self.phase == _BODY and placement is None:
            self.phase = _PICKED  # a local reply: answered, nothing to release
        if self.phase not in (_PICKED, _RESPONSE):
            raise self._out_of_order(kind)
        if kind == "response_headers":
            if self.phase != _PICKED:
                raise self._out_of_order(kind)
            if placement is not None:
                self._started(req, placement)
            out, eos = _EMPTY_RESP_HEADERS, req.response_headers.end_of_stream
        elif kind == "response_body":
            rb = req.response_body
            if self._first and rb.body and placement is not None:
                self._first = False
                self._picker.first_chunk(placement)
            out = _streamed_response_body(rb) if self._resp_duplex else _EMPTY_RESP_BODY
            eos = rb.end_of_stream
        else:
            out, eos = _EMPTY_RESP_TRAILERS, True
        self.phase = _DONE if eos else _RESPONSE
        if eos and placement is not None:
            self.placement = None
            self._picker.release(placement, "response_end")
        return (out,)

    def _started(self, req: ep.ProcessingRequest, placement: Placement) -> None:
        self._picker.response_started(placement)
        served = served_endpoint(req, self._settings.metadata_namespace)
        if served and served != placement.address:
            gm.SERVED_ELSEWHERE.inc()


def _streamed_response_body(rb: ep.HttpBody) -> ep.ProcessingResponse:
    """FULL_DUPLEX_STREAMED response: the chunk handed back as it came."""
    return ep.ProcessingResponse(
        response_body=ep.BodyResponse(
            response=ep.CommonResponse(
                body_mutation=ep.BodyMutation(
                    streamed_response=ep.StreamedBodyResponse(
                        body=rb.body, end_of_stream=rb.end_of_stream
                    )
                )
            )
        )
    )


def _never_fits(adapter: DecodeAdapter, kv: int, subset: list[str] | None) -> str | None:
    """Why no allowed live rank could ever hold ``kv`` tokens (None when one could)."""
    view = adapter._state.view
    caps = np.where(view.live, view.max_kv_tokens, 0)
    allowed = adapter._allowed(subset)
    if allowed is not None:
        caps = caps[: allowed.shape[0]][allowed] if allowed.dtype == np.bool_ else caps[allowed]
    cap = int(caps.max()) if caps.size else 0
    if cap == 0 or kv <= cap:
        return None
    return (
        f"prompt + max_tokens: estimated {kv} tokens, more than any endpoint can hold "
        f"({cap} tokens: the largest max_kv_tokens of a live rank)"
    )


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """One ``Process`` stream per HTTP request (see the module docstring)."""

    def __init__(self, picker: Picker) -> None:
        self._picker = picker

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        picker = self._picker
        stream = _Stream(picker, asyncio.get_running_loop().time())
        admitted = picker.streams < picker.settings.max_streams
        if admitted:
            picker.streams += 1
        it = aiter(request_iterator)
        try:
            while True:
                try:
                    req = await stream.next(it)
                except StopAsyncIteration:
                    return
                if not admitted:
                    n = picker.settings.max_streams
                    raise _refuse(
                        "streams", 429, f"gateway: {n} ext_proc streams open "
                        "(gateway.max_streams)", picker.settings.retry_after_s,
                    )
                for answer in await stream.handle(req):
                    yield answer
        except _Refused as refused:
            stream.close()  # release before answering: the refusal is final
            yield picker.immediate(refused.refusal)
            await drain(it)
        finally:
            stream.close()
            if admitted:
                picker.streams -= 1


def add_to_server(server: grpc.aio.Server, picker: Picker) -> str:
    """Add the ext_proc servicer; returns its full service name."""
    ep_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(picker), server)
    return SERVICE
