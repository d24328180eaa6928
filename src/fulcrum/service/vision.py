"""VisionBalancerService: place images on VE GPUs by patches in flight.

Thin: validate ids, convert protobuf <-> state types, call :class:`VisionState`, reply.
The streaming call runs the very same functions per message and answers errors in the
reply (code + message) instead of ending the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from fulcrum.core.types import MemberKind
from fulcrum.metrics import tenants as tm
from fulcrum.service.app import App
from fulcrum.service.errors import require_id
from fulcrum.service.placement import check_request_id, liveness, register_table, release_id
from fulcrum.service.streams import place_release_stream
from fulcrum.service.tenants import class_of, install_filter, tenancy_of, vision_caps
from fulcrum.state.vision import ImageRequest, VisionState
from fulcrum.v1 import vision_pb2 as pb
from fulcrum.v1 import vision_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["VisionBalancerService"].full_name
log = structlog.get_logger(__name__)


class VisionServicer(pb_grpc.VisionBalancerServiceServicer):
    """PlaceImages / ReleaseImages (unary and streamed) and GetMachineLoad."""

    def __init__(self, app: App, state: VisionState) -> None:
        self._app = app
        self._state = state
        self._tenancy = tenancy_of(app)

    # -- shared by unary and streaming ---------------------------------------------------

    def place(self, request: pb.PlaceImagesRequest, reply: pb.PlaceImagesResponse) -> None:
        """One PlaceImages, unary or streamed: fills ``reply`` (untouched on error)."""
        state = self._state
        request_id = request.request_id
        check_request_id(request_id, state.count_refused)
        # The repeated field's length is bounded before any element is converted.
        state.check_image_count(len(request.images))
        images = [ImageRequest(im.width, im.height, im.patch_size) for im in request.images]
        cls = class_of(self._tenancy, request, state.count_refused)
        placed = state.place(request_id, images, self._app.clock(), cls=cls)
        reply.policy = state.policy_name
        reply.lease_ms = state.lease_ms
        add = reply.placements.add
        for p in placed:
            add(machine_id=p.machine_id, gpu_index=p.gpu_index, patches=p.patches)

    def release(self, request: pb.ReleaseImagesRequest, reply: pb.ReleaseImagesResponse) -> None:
        """One ReleaseImages, unary or streamed: fills ``reply`` (untouched on error)."""
        request_id = release_id(request.request_id, self._state)
        reply.images, reply.patches = self._state.release(request_id, self._app.clock())

    # -- RPCs ----------------------------------------------------------------------------

    async def PlaceImages(
        self, request: pb.PlaceImagesRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlaceImagesResponse:
        reply = pb.PlaceImagesResponse()
        self.place(request, reply)
        return reply

    async def ReleaseImages(
        self, request: pb.ReleaseImagesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseImagesResponse:
        reply = pb.ReleaseImagesResponse()
        self.release(request, reply)
        return reply

    async def PlaceImagesStream(
        self,
        request_iterator: AsyncIterator[pb.PlaceImagesStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.PlaceImagesStreamResponse]:
        replies = place_release_stream(
            request_iterator, pb.PlaceImagesStreamResponse, self.place, self.release
        )
        async for reply in replies:
            yield reply

    async def GetMachineLoad(
        self, request: pb.GetMachineLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetMachineLoadResponse:
        machine_id = require_id(request.machine_id, "machine_id")
        per_gpu, max_patches, images = self._state.machine_load(machine_id)
        return pb.GetMachineLoadResponse(
            machine_id=machine_id,
            patches_in_flight=per_gpu,
            max_patches_in_flight=max_patches,
            images=images,
        )


def register(server: grpc.aio.Server, app: App) -> list[str]:
    """Build the VE state from ``app.settings.vision``, follow VE machines, add the servicer."""
    # An independent stream spawned from the daemon's seeded source: vision decisions
    # depend only on server.seed and the vision calls, not on other balancers' draws.
    rng = app.rng.spawn(1)[0]
    state = VisionState(app.settings.vision, rng, liveness=liveness(app))
    install_filter(app, "vision", state, vision_caps, lambda r: sum(r.patches),
                   (tm.VISION_HELD, None))
    servicer = VisionServicer(app, state)
    add = pb_grpc.add_VisionBalancerServiceServicer_to_server
    register_table(server, app, "vision", MemberKind.VISION_MACHINE, state, add, servicer)
    return [SERVICE]
