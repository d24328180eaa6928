"""FleetService: registration, heartbeats and departures of engines and machines.

Conversion between protobuf and the core's member types happens here, once.
"""

from __future__ import annotations

from typing import Any

import grpc
import structlog

from fulcrum.core.prefill.affinity import MAX_CAPACITY_BLOCKS
from fulcrum.core.types import (
    DecodeInstanceLoad,
    DecodeInstanceShape,
    Member,
    MemberKind,
    MemberLoad,
    MemberShape,
    PrefillEngineShape,
    VisionMachineLoad,
    VisionMachineShape,
)
from fulcrum.errors import InvalidArgument, NotFound
from fulcrum.gateway.registry import AddressBook, validate_addresses
from fulcrum.metrics import FLEET_EVENTS, FLEET_MEMBERS
from fulcrum.service.app import App
from fulcrum.service.paging import page_size_of, page_token_of
from fulcrum.service.prefill import assignment_pb
from fulcrum.state.prefill.adopt import Held, validate_held
from fulcrum.units import NS_PER_MS
from fulcrum.v1 import fleet_pb2 as pb
from fulcrum.v1 import fleet_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["FleetService"].full_name
log = structlog.get_logger(__name__)

KIND_TO_PB = {
    MemberKind.PREFILL_ENGINE: pb.MEMBER_KIND_PREFILL_ENGINE,
    MemberKind.DECODE_INSTANCE: pb.MEMBER_KIND_DECODE_INSTANCE,
    MemberKind.VISION_MACHINE: pb.MEMBER_KIND_VISION_MACHINE,
}
PB_TO_KIND = {v: k for k, v in KIND_TO_PB.items()}

#: ListMembers: members per page by default and at most; GPUs per page at most (a VE
#: machine's detail has one entry per GPU).
DEFAULT_MEMBERS_PAGE = 100
MAX_MEMBERS_PAGE = 256
MAX_MEMBERS_PAGE_GPUS = 8192


def _bound(field: str, length: int, max_gpus: int) -> None:
    """Refuse a repeated field longer than ``fleet.max_gpus_per_member`` before any of it
    is converted (a huge list must not stall the event loop)."""
    if length > max_gpus:
        raise InvalidArgument(
            field, f"must have at most {max_gpus} entries (fleet.max_gpus_per_member)"
        )


def shape_from_pb(request: pb.RegisterRequest, max_gpus: int) -> MemberShape:
    """The member shape of a RegisterRequest (INVALID_ARGUMENT when none is set or a list
    is longer than ``max_gpus``)."""
    which = request.WhichOneof("shape")
    if which == "prefill_engine":
        p = request.prefill_engine
        if p.prefix_cache_blocks > MAX_CAPACITY_BLOCKS:
            raise InvalidArgument("prefill_engine.prefix_cache_blocks",
                                  f"must be <= {MAX_CAPACITY_BLOCKS}")
        return PrefillEngineShape(dp_ranks=p.dp_ranks, step_quota_ns=p.step_quota_ns,
                                  prefix_cache_blocks=p.prefix_cache_blocks,
                                  prefix_cache_survived=p.prefix_cache_survived)
    if which == "decode_instance":
        gpus = request.decode_instance.gpus
        _bound("decode_instance.gpus", len(gpus), max_gpus)
        return DecodeInstanceShape(
            max_concurrency=tuple(g.max_concurrency for g in gpus),
            max_kv_tokens=tuple(g.max_kv_tokens for g in gpus),
        )
    if which == "vision_machine":
        v = request.vision_machine
        return VisionMachineShape(gpus=v.gpus, max_patches_in_flight=v.max_patches_in_flight)
    raise InvalidArgument("shape", "one of prefill_engine, decode_instance, vision_machine")


def load_from_pb(request: pb.HeartbeatRequest, max_gpus: int) -> MemberLoad | None:
    """The observed load of a heartbeat, if any (lists longer than ``max_gpus`` are
    refused before conversion)."""
    which = request.WhichOneof("load")
    if which == "decode_instance":
        gpus = request.decode_instance.gpus
        _bound("decode_instance.gpus", len(gpus), max_gpus)
        return DecodeInstanceLoad(
            concurrency=tuple(g.concurrency for g in gpus),
            kv_tokens=tuple(g.kv_tokens for g in gpus),
        )
    if which == "vision_machine":
        patches = request.vision_machine.patches_in_flight
        _bound("vision_machine.patches_in_flight", len(patches), max_gpus)
        return VisionMachineLoad(tuple(patches))
    return None


def fill_info(components: dict[str, Any], member: Member, out: pb.Member) -> None:
    """Kind-specific detail of ``member`` from its balancer's public reads (left unset
    when the balancer does not know the member)."""
    mid = member.member_id
    shape = member.shape
    if isinstance(shape, PrefillEngineShape):
        prefill = components.get("prefill")
        if prefill is None:
            return
        entry = prefill.balancer.engine(mid)
        if entry is None:
            return
        tier = entry.tier
        info = out.prefill_engine
        info.dp_ranks = shape.dp_ranks
        info.step_quota_ns = shape.step_quota_ns
        info.load_ns = max(0, entry.load_ns)
        if 0 <= tier < len(prefill.labels):
            info.has_tier = True
            info.tier = tier
            info.tier_label = prefill.labels[tier]
    elif isinstance(shape, DecodeInstanceShape):
        decode = components.get("decode")
        loads = None if decode is None else decode.instance_load(mid)
        if loads is None:
            return
        conc, kv = loads
        d = out.decode_instance
        d.concurrency = sum(conc)
        d.kv_tokens = sum(kv)
        d.max_gpu_concurrency = max(conc)
        d.max_gpu_kv_tokens = max(kv)
    else:
        vision = components.get("vision")
        if vision is None:
            return
        try:
            per_gpu, _, images = vision.machine_load(mid)
        except NotFound:
            return
        v = out.vision_machine
        v.patches_in_flight.extend(per_gpu)
        v.images = images


class FleetServicer(pb_grpc.FleetServiceServicer):
    """Thin: convert, call the fleet table, reply."""

    def __init__(self, app: App) -> None:
        self._app = app
        self._fleet = app.fleet
        self._addresses: AddressBook = app.components["serving_addresses"]

    def _gauge(self) -> None:
        for kind in MemberKind:
            FLEET_MEMBERS.labels(kind.value).set(self._fleet.count(kind))

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        shape = shape_from_pb(request, self._fleet.settings.max_gpus_per_member)
        # the gateway's serving addresses, validated before admission (shape_from_pb
        # has already bounded the GPU count)
        addresses = validate_addresses([g.serving_address for g in request.decode_instance.gpus])
        held = self._held(request)  # validated before anything changes
        member, replaced = self._fleet.register(request.member_id, shape, self._app.clock())
        self._addresses.record(member, addresses)
        if held:
            self._app.components["prefill"].adopt(member.member_id, held)
        # No log line here: the member's balancer logs the join (and, for a new
        # incarnation, the old one's leave with what it lost), once.
        event = "rejoined" if replaced else "joined"
        FLEET_EVENTS.labels(member.kind.value, event).inc()
        self._gauge()
        fs = self._fleet.settings
        return pb.RegisterResponse(
            incarnation=member.incarnation,
            heartbeat_interval_ms=fs.heartbeat_interval_ms,
            heartbeat_timeout_ms=fs.heartbeat_timeout_ms,
            prefill=self._prefill_assignment(member),
        )

    def _held(self, request: pb.RegisterRequest) -> list[Held]:
        """The requests a registering prefill engine still holds (validated; empty for
        other kinds or when this daemon runs no prefill balancer)."""
        state = self._app.components.get("prefill")
        if request.WhichOneof("shape") != "prefill_engine" or state is None:
            return []
        shape = request.prefill_engine
        held = [Held(h.request_id, int(h.dp_rank), int(h.total_tokens), int(h.cached_tokens))
                for h in shape.held]
        validate_held(held, int(shape.dp_ranks))
        return held

    def _prefill_assignment(self, member: Member) -> pb.PrefillAssignment | None:
        """A prefill engine's tier, horizon and step budget (issue 13); None otherwise."""
        state = self._app.components.get("prefill")
        if member.kind is not MemberKind.PREFILL_ENGINE or state is None:
            return None
        return assignment_pb(state, member.member_id)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        load = load_from_pb(request, self._fleet.settings.max_gpus_per_member)
        member = self._fleet.heartbeat(
            request.member_id, request.incarnation, load, self._app.clock()
        )
        return pb.HeartbeatResponse(
            heartbeat_timeout_ms=self._fleet.settings.heartbeat_timeout_ms,
            prefill=self._prefill_assignment(member),
        )

    async def Deregister(
        self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterResponse:
        member = self._fleet.deregister(request.member_id, request.incarnation, self._app.clock())
        FLEET_EVENTS.labels(member.kind.value, "left").inc()
        self._gauge()  # the balancer logs the leave (once)
        return pb.DeregisterResponse()

    async def ListMembers(
        self, request: pb.ListMembersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMembersResponse:
        kind = None
        if request.kind != pb.MEMBER_KIND_UNSPECIFIED:
            if request.kind not in PB_TO_KIND:
                raise InvalidArgument("kind", "unknown member kind")
            kind = PB_TO_KIND[request.kind]
        limit = page_size_of(request.page_size, DEFAULT_MEMBERS_PAGE, MAX_MEMBERS_PAGE)
        after = page_token_of(request.page_token)
        now = self._app.clock()
        reply = pb.ListMembersResponse()
        members = reply.members
        gpus = 0
        components = self._app.components
        for m, seen in self._fleet.live_members(now, kind, after=after):
            n = m.shape.gpus
            if len(members) >= limit or (members and gpus + n > MAX_MEMBERS_PAGE_GPUS):
                reply.next_page_token = members[-1].member_id
                break
            gpus += n
            item = members.add(
                member_id=m.member_id,
                kind=KIND_TO_PB[m.kind],
                incarnation=m.incarnation,
                since_heartbeat_ms=max(0, now - seen) // NS_PER_MS,
                gpus=n,
            )
            fill_info(components, m, item)
        return reply

    def sweep(self, now_ns: int) -> None:
        """Take lapsed members out of placement (periodic)."""
        for member in self._fleet.expire(now_ns):
            FLEET_EVENTS.labels(member.kind.value, "lapsed").inc()  # logged by its balancer
        self._gauge()


def register(server: grpc.aio.Server, app: App) -> list[str]:
    book = AddressBook()
    app.components["serving_addresses"] = book
    app.fleet.add_listener(MemberKind.DECODE_INSTANCE, book)
    servicer = FleetServicer(app)
    pb_grpc.add_FleetServiceServicer_to_server(servicer, server)
    fleet = app.fleet
    app.reload_hooks.append(lambda new: fleet.apply_settings(new.fleet))
    app.every(lambda: fleet.settings.sweep_interval_ms / 1000, servicer.sweep, "fleet-sweep")
    app.components["fleet"] = app.fleet
    return [SERVICE]
