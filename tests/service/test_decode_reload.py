"""A reload applies every key of the decode and vision sections, through real gRPC.

One convention for both placement tables (``apply_settings``): lease, table bound, the
largest request, the sweep period, the per-GPU series bound and the policy all apply to
the next call; placements already held keep their deadline.
"""

from __future__ import annotations

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.config import with_overrides
from fulcrum.service.server import Daemon
from fulcrum.state.decode import DecodeState
from fulcrum.state.vision import VisionState
from fulcrum.testing import running_server
from fulcrum.v1 import decode_pb2 as dpb
from fulcrum.v1 import fleet_pb2 as fpb
from fulcrum.v1 import vision_pb2 as vpb


def reload(daemon: Daemon, overrides: dict[str, object]) -> None:
    new = with_overrides(daemon.app.settings, overrides)
    for hook in daemon.app.reload_hooks:
        hook(new)


async def test_reload_applies_every_decode_and_vision_key() -> None:
    async with running_server() as daemon, FulcrumClient(daemon.address) as client:
        gpus = [fpb.DecodeGpuCapacity(max_concurrency=64, max_kv_tokens=1_000_000)] * 2
        await client.fleet.Register(
            fpb.RegisterRequest(member_id="d", decode_instance=fpb.DecodeInstanceShape(gpus=gpus))
        )
        await client.fleet.Register(
            fpb.RegisterRequest(member_id="v", vision_machine=fpb.VisionMachineShape(gpus=2))
        )
        r = await client.decode.PlaceDecode(dpb.PlaceDecodeRequest(request_id="a", kv_tokens=10))
        assert (r.lease_ms, r.policy) == (600_000, "dual")
        reload(daemon, {
            "decode": {
                "lease_ms": 5_000, "max_placements": 2, "max_request_kv_tokens": 1_000,
                "policy": "least_kv", "sweep_interval_ms": 50, "metrics_gpu_series": 1,
            },
            "vision": {
                "lease_ms": 7_000, "max_placements": 1, "max_images_per_request": 2,
                "policy": "least_patches", "patch_size": 32, "sweep_interval_ms": 60,
                "metrics_gpu_series": 1,
            },
        })
        r = await client.decode.PlaceDecode(dpb.PlaceDecodeRequest(request_id="b", kv_tokens=10))
        assert (r.lease_ms, r.policy) == (5_000, "least_kv")
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the new bound: 2 held
            await client.decode.PlaceDecode(dpb.PlaceDecodeRequest(request_id="c", kv_tokens=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "decode.max_placements" in (err.value.details() or "")
        await client.decode.ReleaseDecode(dpb.ReleaseDecodeRequest(request_id="a"))
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the new largest request
            await client.decode.PlaceDecode(
                dpb.PlaceDecodeRequest(request_id="c", kv_tokens=1_001)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kv_tokens: must be in [1, 1000]" in (err.value.details() or "")

        image = vpb.Image(width=64, height=64)
        v = await client.vision.PlaceImages(vpb.PlaceImagesRequest(request_id="i", images=[image]))
        assert (v.lease_ms, v.policy, v.placements[0].patches) == (7_000, "least_patches", 4)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # vision.max_placements = 1
            await client.vision.PlaceImages(vpb.PlaceImagesRequest(request_id="j", images=[image]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await client.vision.ReleaseImages(vpb.ReleaseImagesRequest(request_id="i"))
        with pytest.raises(grpc.aio.AioRpcError) as err:  # max_images_per_request = 2
            await client.vision.PlaceImages(
                vpb.PlaceImagesRequest(request_id="j", images=[image] * 3)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "vision.max_images_per_request" in (err.value.details() or "")

        decode = daemon.app.components["decode"]
        vision = daemon.app.components["vision"]
        assert isinstance(decode, DecodeState) and isinstance(vision, VisionState)
        assert decode.settings.sweep_interval_ms == 50
        assert vision.settings.sweep_interval_ms == 60
        assert decode.publisher.current().gpu_series == 1
        assert vision.publisher.current().gpu_series == 1


async def test_images_are_bounded_before_conversion() -> None:
    """200,000 images (2.2 MB) are refused on the repeated field's length, naming the
    bound; exactly the bound is accepted."""
    async with running_server() as daemon, FulcrumClient(daemon.address) as client:
        await client.fleet.Register(
            fpb.RegisterRequest(member_id="v", vision_machine=fpb.VisionMachineShape(gpus=2))
        )
        image = vpb.Image(width=64, height=64)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.vision.PlaceImages(
                vpb.PlaceImagesRequest(request_id="big", images=[image] * 200_000)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(
            "images: must have at most 64 entries (vision.max_images_per_request), got 200000"
        )
        ok = await client.vision.PlaceImages(
            vpb.PlaceImagesRequest(request_id="bound", images=[image] * 64)
        )
        assert len(ok.placements) == 64
        vision = daemon.app.components["vision"]
        assert isinstance(vision, VisionState) and vision.held == 1
