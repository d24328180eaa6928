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
  closes (client gone, upstream reset, Envoy done).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
import structlog
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from fulcrum.config.gateway import GatewaySettings
from fulcrum.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from fulcrum.gateway import metrics as gm
from fulcrum.gateway.adapter import DecodeAdapter, NoEligibleEndpoint, Placement
from fulcrum.gateway.body import RequestShape, TokenCounter, parse_body
from fulcrum.gateway.cache_pick import CachePicker
from fulcrum.gateway.prefill import PrefillProxy

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

#: Cached destination answers (distinct primary + fallbacks values x 2 phases).
_CACHE_MAX = 8192

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
    md = req.metadata_context.filter_metadata
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
        self.in_flight = 0
        self.streams = 0
        self._picked = gm.PICKS.labels(adapter.policy_name, "picked")
        self._policy = adapter.policy_name
        self._answers: dict[tuple[str, str, str], ep.ProcessingResponse] = {}
        self._releases = {r: gm.RELEASES.labels(r) for r in gm.RELEASE_REASONS}
        #: Test hook: called with (request_id, Placement) after each pick.
        self.pick_hooks: list[Callable[[str, Placement], None]] = []
        #: Test hook: called with (request_id, reason) after each release.
        self.release_hooks: list[Callable[[str, str], None]] = []
        #: Cache-aware picks (gateway.cache.enabled, engines without a prefill pool).
        self.cache: CachePicker | None = None
        if settings.cache.enabled and prefill is None:
            cache = CachePicker(settings.cache, settings.chars_per_token, adapter)
            cache.default_kv_tokens = max(
                (e.max_kv_tokens for e in settings.pool.decode), default=0
            )
            self.cache = cache
            self.release_hooks.append(lambda rid, why: cache.released(rid, why, clock()))

    def apply_settings(self, settings: GatewaySettings) -> None:
        """Reload: every key but the restart-only ones (enabled, host, ports, pool)."""
        self.settings = settings
        self._answers.clear()  # the metadata namespace may have changed

    def _count(self, outcome: str) -> None:
        if outcome == "picked" and self._policy == self.adapter.policy_name:
            self._picked.inc()
            return
        self._policy = self.adapter.policy_name
        self._picked = gm.PICKS.labels(self._policy, "picked")
        gm.PICKS.labels(self._policy, outcome).inc()

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

    def pick(
        self,
        body: bytes,
        path: str,
        subset: list[str] | None,
        shape: RequestShape | None = None,
    ) -> Placement | Refusal:
        """Choose the destination of one request (placement held until :meth:`release`).
        ``shape``: the body already parsed (off the loop), else it is parsed here."""
        t0 = time.perf_counter()
        s = self.settings
        if self.in_flight >= s.max_in_flight:
            self._count("shed")
            return Refusal(
                429, "shed", f"gateway: {s.max_in_flight} requests in flight", s.retry_after_s
            )
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
                request_id, kv, now, subset=subset, fallbacks=s.fallbacks, pin=pin
            )
        except NoEligibleEndpoint as err:
            self._count("no_endpoint")
            return Refusal(503, "no_endpoint", f"gateway: {err}")
        except ResourceExhausted as err:
            self._count("shed")
            retry = max(s.retry_after_s, -(-err.retry_after_ms // 1000))
            return Refusal(429, "shed", err.message, retry)
        except (InvalidArgument, AlreadyExists) as err:
            self._count("bad_request")
            return Refusal(400, "bad_request", err.message)
        if self.prefill is not None:
            placement = replace(placement, prompt_tokens=shape.prompt_tokens)
        if choice is not None and self.cache is not None:
            self.cache.placed(request_id, choice, shape.prompt_tokens, now)
        self.in_flight += 1
        gm.IN_FLIGHT.set(self.in_flight)
        self._count("picked")
        gm.PICK_SECONDS.observe(time.perf_counter() - t0)
        for hook in self.pick_hooks:
            hook(request_id, placement)
        return placement

    async def pick_full(
        self, body: bytes, path: str, subset: list[str] | None
    ) -> Placement | Refusal:
        """:meth:`pick`, then (P/D, a request with a prompt) :meth:`pick_prefill`. A body
        over ``OFFLOAD_BYTES`` is parsed (and tokenized) in a worker thread, so that the
        event loop never spends more than a few ms on one request."""
        shape = None
        if len(body) > OFFLOAD_BYTES or (self.counter is not None and body):
            loop = asyncio.get_running_loop()
            shape = await loop.run_in_executor(None, self.parse, body, path)
        out = self.pick(body, path, subset, shape)
        if self.prefill is not None and isinstance(out, Placement) and out.prompt_tokens > 0:
            return await self.pick_prefill(out)
        return out

    async def pick_prefill(self, placement: Placement) -> Placement | Refusal:
        """P/D: choose the prefill engine and rank with the prefill balancer (waits for a
        pull made on an engine's behalf). On a refusal the decode placement is released."""
        assert self.prefill is not None
        s = self.settings
        try:
            prefiller = await self.prefill.place(placement.request_id, placement.prompt_tokens)
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
        return replace(placement, prefiller=prefiller)

    def response_started(self, placement: Placement) -> None:
        """Response headers came back: the request's prefill is done."""
        if self.prefill is not None and placement.prefiller:
            self.prefill.finished(placement.request_id)

    def release(self, placement: Placement, reason: str) -> None:
        """End a request's placement (once per pick)."""
        if self.prefill is not None:
            self.prefill.finished(placement.request_id)
        self.in_flight -= 1
        gm.IN_FLIGHT.set(self.in_flight)
        held = self.adapter.release(placement.request_id, self._clock())
        self._releases[reason if held else "not_held"].inc()
        for hook in self.release_hooks:
            hook(placement.request_id, reason if held else "not_held")

    # -- answers -------------------------------------------------------------------------

    def destination(self, placement: Placement, phase: str) -> ep.ProcessingResponse:
        """The answer of ``phase`` ("request_headers" or "request_body") carrying the
        destination: header mutation with the route cache cleared, and the same value in
        dynamic metadata. Answers are immutable once built, so they are cached per value
        (bounded: at most ``_CACHE_MAX`` entries, then the cache starts over)."""
        value = (
            placement.address
            if not placement.fallbacks
            else ",".join((placement.address, *placement.fallbacks))
        )
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
        if len(self._answers) >= _CACHE_MAX:
            self._answers.clear()
        self._answers[key] = answer
        return answer

    @staticmethod
    def immediate(refusal: Refusal) -> ep.ProcessingResponse:
        gm.IMMEDIATE.labels(str(refusal.code)).inc()
        headers = [_header("content-type", "application/json")]
        if refusal.code == 429:
            headers.append(_header("retry-after", str(refusal.retry_after_s)))
        body = (
            '{"error":{"message":' + _json_str(refusal.message) + ',"type":"'
            + refusal.outcome + '","code":' + str(refusal.code) + "}}"
        )
        return ep.ProcessingResponse(
            immediate_response=ep.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=_STATUS[refusal.code]),
                headers=ep.HeaderMutation(set_headers=headers),
                body=body.encode(),
                details=f"fulcrum_{refusal.outcome}",
            )
        )


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


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """One ``Process`` stream per HTTP request (see the module docstring)."""

    def __init__(self, picker: Picker) -> None:
        self._picker = picker

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        picker = self._picker
        settings = picker.settings
        placement: Placement | None = None
        picker.streams += 1
        gm.STREAMS.set(picker.streams)
        duplex = False
        resp_duplex = False
        body_none = False
        pending_headers = False
        path = ""
        subset: list[str] | None = None
        chunks: list[bytes] = []
        size = 0
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    if req.HasField("protocol_config"):
                        pc = req.protocol_config
                        duplex = pc.request_body_mode == _FULL_DUPLEX
                        resp_duplex = pc.response_body_mode == _FULL_DUPLEX
                        body_none = pc.request_body_mode == _BODY_NONE
                    hs = req.request_headers
                    for h in hs.headers.headers:
                        if h.key == ":path":
                            path = _header_value(h)
                            break
                    subset = subset_hint(req, settings.subset_namespace)
                    if hs.end_of_stream or body_none:
                        out = await picker.pick_full(b"", path, subset)
                        if isinstance(out, Refusal):
                            yield picker.immediate(out)
                            return
                        placement = out
                        yield picker.destination(out, "request_headers")
                    elif duplex:
                        pending_headers = True  # answered once the body is complete
                    else:
                        yield _EMPTY_REQ_HEADERS
                elif kind == "request_body":
                    b = req.request_body
                    if b.body:
                        size += len(b.body)
                        if size > settings.max_body_bytes:
                            gm.PICKS.labels(picker.adapter.policy_name, "too_large").inc()
                            yield picker.immediate(
                                Refusal(
                                    413,
                                    "too_large",
                                    f"request body over {settings.max_body_bytes} bytes "
                                    "(gateway.max_body_bytes)",
                                )
                            )
                            return
                        chunks.append(b.body)
                    if not b.end_of_stream:
                        if not duplex:
                            yield _EMPTY_REQ_BODY  # STREAMED mode: one answer per chunk
                        continue
                    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    chunks = []
                    out = await picker.pick_full(body, path, subset)
                    if isinstance(out, Refusal):
                        yield picker.immediate(out)
                        return
                    placement = out
                    if duplex:
                        if pending_headers:
                            pending_headers = False
                            yield picker.destination(out, "request_headers")
                        yield _streamed_request_body(body, True)
                    else:
                        yield picker.destination(out, "request_body")
                elif kind == "request_trailers":
                    if duplex and pending_headers:
                        # A request with trailers: the body ended without end_of_stream.
                        body = b"".join(chunks)
                        chunks = []
                        out = await picker.pick_full(body, path, subset)
                        if isinstance(out, Refusal):
                            yield picker.immediate(out)
                            return
                        placement = out
                        pending_headers = False
                        yield picker.destination(out, "request_headers")
                        yield _streamed_request_body(body, False)
                    yield _EMPTY_REQ_TRAILERS
                elif kind == "response_headers":
                    if placement is not None:
                        picker.response_started(placement)
                        served = served_endpoint(req, settings.metadata_namespace)
                        if served and served != placement.address:
                            gm.SERVED_ELSEWHERE.inc()
                    yield _EMPTY_RESP_HEADERS
                    if req.response_headers.end_of_stream and placement is not None:
                        picker.release(placement, "response_end")
                        placement = None
                elif kind == "response_body":
                    rb = req.response_body
                    if resp_duplex:
                        yield ep.ProcessingResponse(
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
                    else:
                        yield _EMPTY_RESP_BODY
                    if rb.end_of_stream and placement is not None:
                        picker.release(placement, "response_end")
                        placement = None
                elif kind == "response_trailers":
                    yield _EMPTY_RESP_TRAILERS
                    if placement is not None:
                        picker.release(placement, "response_end")
                        placement = None
        finally:
            picker.streams -= 1
            gm.STREAMS.set(picker.streams)
            if placement is not None:
                picker.release(placement, "stream_closed")


def add_to_server(server: grpc.aio.Server, picker: Picker) -> str:
    """Add the ext_proc servicer; returns its full service name."""
    ep_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(picker), server)
    return SERVICE
