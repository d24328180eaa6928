"""PrefillBalancerService: placeholder until the balancer lands; every method answers UNIMPLEMENTED."""

from __future__ import annotations

from typing import Any

import grpc

from fulcrum.errors import Unimplemented
from fulcrum.service.app import App
from fulcrum.v1 import prefill_pb2 as pb
from fulcrum.v1 import prefill_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["PrefillBalancerService"].full_name


class _Placeholder(pb_grpc.PrefillBalancerServiceServicer):
    def __getattribute__(self, name: str) -> Any:
        if name[:1].isupper():

            async def unimplemented(*_: Any) -> Any:
                raise Unimplemented(f"{SERVICE}/{name} is not implemented yet")

            return unimplemented
        return super().__getattribute__(name)


def register(server: grpc.aio.Server, app: App) -> list[str]:
    pb_grpc.add_PrefillBalancerServiceServicer_to_server(_Placeholder(), server)
    return [SERVICE]
