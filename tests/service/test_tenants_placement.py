"""Decode and vision with classes, through real gRPC channels (issue 23): a tenant's
caps on concurrency and KV are one more filter (RESOURCE_EXHAUSTED with retry-after-ms,
freed by a release), and a sheddable band is refused first as the fleet fills."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.testing import running_server
from fulcrum.v1 import decode_pb2, vision_pb2
from tests.polling import until
from tests.service.test_decode import add_instance
from tests.service.test_decode_reload import reload
from tests.service.test_server import scrape
from tests.service.test_vision import add_machine

TENANTS: dict[str, Any] = {
    "classes": {
        "few": {"decode_max_concurrency": 2, "vision_max_concurrency": 1},
        "small": {"decode_max_kv_tokens": 1000},
    },
    "min_priority": -1,
    "max_priority": 1,
    "sheddable_priorities": [-1],
}


def place(request_id: str, kv: int = 100, **fields: Any) -> decode_pb2.PlaceDecodeRequest:
    return decode_pb2.PlaceDecodeRequest(request_id=request_id, kv_tokens=kv, **fields)


def gauge(d: Any, name: str, tenant: str) -> float | None:
    return scrape(d).get((name, (("tenant", tenant),)))


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(err.value.trailing_metadata() or ())
    assert int(trailing["retry-after-ms"]) >= 1
    return err.value


async def test_decode_caps_per_tenant() -> None:
    async with (running_server({"tenants": TENANTS}) as d,
                FulcrumClient(d.address, timeout_s=10.0) as c):
        await add_instance(c, "dec-1", gpus=((64, 1_000_000),) * 2)
        await c.decode.PlaceDecode(place("f1", tenant="few"))
        await c.decode.PlaceDecode(place("f2", tenant="few"))
        err = await refused(c.decode.PlaceDecode(place("f3", tenant="few")))
        assert "tenant 'few' holds 2 requests (its cap: 2)" in (err.details() or "")
        await c.decode.PlaceDecode(place("o1"))  # other tenants are not held back
        await c.decode.ReleaseDecode(decode_pb2.ReleaseDecodeRequest(request_id="f1"))
        await c.decode.PlaceDecode(place("f3", tenant="few"))  # the release freed one
        await c.decode.PlaceDecode(place("s1", 600, tenant="small"))
        await refused(c.decode.PlaceDecode(place("s2", 600, tenant="small")))
        await c.decode.PlaceDecode(place("s2", 400, tenant="small"))
        assert scrape(d)[("fulcrum_tenant_shed_total", (("balancer", "decode"),
                          ("reason", "cap"), ("tenant", "few")))] >= 1
        # the per-tenant gauges are set every sweep period (decode.sweep_interval_ms)
        await until(lambda: gauge(d, "fulcrum_tenant_decode_placements", "few") == 2
                    and gauge(d, "fulcrum_tenant_decode_kv_tokens", "small") == 1000,
                    "per-tenant decode gauges")


async def test_decode_sheddable_band_is_refused_first_as_the_fleet_fills() -> None:
    over = {"tenants": TENANTS, "decode": {"band_reserve": 0.5}}
    async with running_server(over) as d, FulcrumClient(d.address, timeout_s=10.0) as c:
        await add_instance(c, "dec-1", gpus=((10, 1_000_000),))
        for i in range(5):
            await c.decode.PlaceDecode(place(f"p{i}"))
        # band -1 (sheddable) is refused past 1 - 0.5 * 3/3 = 50 % full
        err = await refused(c.decode.PlaceDecode(place("low", priority=-1)))
        assert "sheddable priority -1" in (err.details() or "")
        await c.decode.PlaceDecode(place("zero", priority=0))  # band 0 is not sheddable
        await c.decode.PlaceDecode(place("high", priority=1))
        m = scrape(d)
        assert m[("fulcrum_tenant_shed_total",
                  (("balancer", "decode"), ("reason", "band"), ("tenant", "default")))] >= 1


async def test_vision_cap_per_tenant() -> None:
    async with (running_server({"tenants": TENANTS}) as d,
                FulcrumClient(d.address, timeout_s=10.0) as c):
        await add_machine(c, "ve-1")
        img = [vision_pb2.Image(width=64, height=64)]
        await c.vision.PlaceImages(vision_pb2.PlaceImagesRequest(
            request_id="v1", images=img, tenant="few"))
        await refused(c.vision.PlaceImages(vision_pb2.PlaceImagesRequest(
            request_id="v2", images=img, tenant="few")))
        await c.vision.PlaceImages(vision_pb2.PlaceImagesRequest(request_id="v3", images=img))
        await c.vision.ReleaseImages(vision_pb2.ReleaseImagesRequest(request_id="v1"))
        await c.vision.PlaceImages(vision_pb2.PlaceImagesRequest(
            request_id="v2", images=img, tenant="few"))
        await until(lambda: gauge(d, "fulcrum_tenant_vision_requests", "few") == 1,
                    "per-tenant vision gauge")


async def test_reloaded_tenant_cap_applies_to_the_next_placement() -> None:
    async with running_server() as d, FulcrumClient(d.address, timeout_s=10.0) as c:
        state = d.app.components["decode"]
        assert state.filters == []  # nothing to enforce: the unfiltered fast path
        await add_instance(c, "dec-1")
        await c.decode.PlaceDecode(place("a1", tenant="t"))
        reload(d, {"tenants": {"classes": {"t": {"decode_max_concurrency": 1}}}})
        assert len(state.filters) == 1
        await c.decode.PlaceDecode(place("a2", tenant="t"))  # counted from the reload on
        await refused(c.decode.PlaceDecode(place("a3", tenant="t")))
        await c.decode.PlaceDecode(place("b1", tenant="u"))
