"""DecodeBalancerService: place requests on decode GPUs by concurrency AND total KV.

Thin: validate ids, convert protobuf <-> state types, call :class:`DecodeState`, reply.
The streaming call runs the very same functions per message and answers errors in the
reply (code + message) instead of ending the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from fulcrum.core.types import DecodeInstanceShape, Member, MemberKind
from fulcrum.errors import NotFound
from fulcrum.metrics import tenants as tm
from fulcrum.service.app import App
from fulcrum.service.errors import require_id
from fulcrum.service.paging import page_size_of, page_token_of
from fulcrum.service.placement import check_request_id, liveness, register_table, release_id
from fulcrum.service.streams import place_release_stream
from fulcrum.service.tenants import class_of, decode_caps, install_filter, tenancy_of
from fulcrum.state.decode import DecodeState
from fulcrum.units import NS_PER_MS
from fulcrum.v1 import decode_pb2 as pb
from fulcrum.v1 import decode_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["DecodeBalancerService"].full_name
log = structlog.get_logger(__name__)

#: GetDecodeLoad: instances per page by default, at most, and GPUs per page at most.
DEFAULT_LOAD_PAGE = 64
MAX_LOAD_PAGE = 256
MAX_LOAD_PAGE_GPUS = 8192


def fill_instance_load(state: DecodeState, member: Member, out: pb.DecodeInstanceState) -> bool:
    """Fill ``out`` with one decode instance's per-GPU load and capacity; False when the
    decode table does not hold the instance (``out`` is then untouched). O(its GPUs)."""
    shape = member.shape
    assert isinstance(shape, DecodeInstanceShape)
    loads = state.instance_load(member.member_id)
    if loads is None:
        return False
    conc, kv = loads
    out.instance_id = member.member_id
    out.incarnation = member.incarnation
    out.concurrency.extend(conc)
    out.kv_tokens.extend(kv)
    out.max_concurrency.extend(shape.max_concurrency)
    out.max_kv_tokens.extend(shape.max_kv_tokens)
    out.total_concurrency = sum(conc)
    out.total_kv_tokens = sum(kv)
    return True


class DecodeServicer(pb_grpc.DecodeBalancerServiceServicer):
    """PlaceDecode / ReleaseDecode, unary and streamed."""

    def __init__(self, app: App, state: DecodeState) -> None:
        self._app = app
        self._state = state
        self._tenancy = tenancy_of(app)

    # -- shared by unary and streaming ---------------------------------------------------

    def place(self, request: pb.PlaceDecodeRequest) -> pb.PlaceDecodeResponse:
        """One PlaceDecode, unary or streamed."""
        reply = pb.PlaceDecodeResponse()
        self.place_into(request, reply)
        return reply

    def place_into(self, request: pb.PlaceDecodeRequest, reply: pb.PlaceDecodeResponse) -> None:
        """One PlaceDecode: fills ``reply`` (untouched on error). The streaming call fills
        its reply's ``place`` field in place (no second message and no copy)."""
        state = self._state
        request_id = request.request_id
        check_request_id(request_id, state.count_refused)
        cls = class_of(self._tenancy, request, state.count_refused)
        r = state.place(request_id, request.kv_tokens, self._app.clock(), cls=cls)
        reply.instance_id = r.instance_id
        reply.gpu_index = r.gpu_index
        reply.policy = state.policy_name
        reply.lease_ms = r.lease_ms
        reply.incarnation = r.incarnation
        reply.branch = r.branch
        reply.gpu_concurrency = r.gpu_concurrency
        reply.gpu_kv_tokens = r.gpu_kv_tokens

    def release(self, request: pb.ReleaseDecodeRequest) -> pb.ReleaseDecodeResponse:
        """One ReleaseDecode, unary or streamed."""
        reply = pb.ReleaseDecodeResponse()
        self.release_into(request, reply)
        return reply

    def release_into(
        self, request: pb.ReleaseDecodeRequest, reply: pb.ReleaseDecodeResponse
    ) -> None:
        """One ReleaseDecode: fills ``reply`` (untouched on error)."""
        state = self._state
        request_id = release_id(request.request_id, state)
        r = state.release(request_id, self._app.clock())
        reply.instance_id = r.instance_id
        reply.gpu_index = r.gpu_index
        reply.held_ms = r.held_ns // NS_PER_MS

    # -- RPCs ----------------------------------------------------------------------------

    async def PlaceDecode(
        self, request: pb.PlaceDecodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlaceDecodeResponse:
        return self.place(request)

    async def ReleaseDecode(
        self, request: pb.ReleaseDecodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseDecodeResponse:
        return self.release(request)

    async def GetDecodeLoad(
        self, request: pb.GetDecodeLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetDecodeLoadResponse:
        state = self._state
        fleet = self._app.fleet
        now = self._app.clock()
        limit = page_size_of(request.page_size, DEFAULT_LOAD_PAGE, MAX_LOAD_PAGE)
        reply = pb.GetDecodeLoadResponse()
        instances = reply.instances
        if request.instance_id:
            instance_id = require_id(request.instance_id, "instance_id")
            member = fleet.get_live(
                instance_id, None, now, MemberKind.DECODE_INSTANCE, "instance_id"
            )
            if not fill_instance_load(state, member, instances.add()):
                raise NotFound(f"instance_id: {instance_id!r} is not a live decode instance")
            return reply
        after = page_token_of(request.page_token)
        gpus = 0
        for member, _ in fleet.live_members(now, MemberKind.DECODE_INSTANCE, after=after):
            n = member.shape.gpus
            if len(instances) >= limit or (instances and gpus + n > MAX_LOAD_PAGE_GPUS):
                reply.next_page_token = instances[-1].instance_id
                break
            if fill_instance_load(state, member, instances.add()):
                gpus += n
            else:
                del instances[-1]
        return reply

    async def PlaceDecodeStream(
        self,
        request_iterator: AsyncIterator[pb.PlaceDecodeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.PlaceDecodeStreamResponse]:
        reply_type = pb.PlaceDecodeStreamResponse
        async for reply in place_release_stream(
            request_iterator, reply_type, self.place_into, self.release_into
        ):
            yield reply


def register(server: grpc.aio.Server, app: App) -> list[str]:
    """Build the decode state from ``app.settings.decode``, follow decode instances, add
    the servicer, sweep leases periodically and apply reloads."""
    state = DecodeState(
        app.settings.decode,
        app.rng,
        liveness=liveness(app),
        debug_log=app.settings.logging.level == "debug",
    )
    install_filter(app, "decode", state, decode_caps, lambda r: int(r.kv_tokens),
                   (tm.DECODE_HELD, tm.DECODE_KV))
    register_table(
        server, app, "decode", MemberKind.DECODE_INSTANCE, state,
        pb_grpc.add_DecodeBalancerServiceServicer_to_server, DecodeServicer(app, state),
    )
    return [SERVICE]
