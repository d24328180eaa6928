"""Tenant, priority and ttft_slo_ms at the service boundary, through real gRPC channels
(issue 23): bad fields are INVALID_ARGUMENT naming the field and change nothing; the
tenant past tenants.max_tenants is folded into the default class and counted, never a
new label."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.core.tenants import MAX_TTFT_SLO_MS
from fulcrum.service.server import Daemon
from fulcrum.service.tenants import Tenancy
from fulcrum.testing import running_server
from fulcrum.v1 import decode_pb2, prefill_pb2, vision_pb2
from tests.service.test_server import scrape

TENANTS = {"classes": {"gold": {"weight": 3.0}}, "max_tenants": 3, "max_tenant_length": 8,
           "min_priority": -2, "max_priority": 2}

Call = Callable[[FulcrumClient, dict[str, Any]], Awaitable[Any]]


async def _submit(c: FulcrumClient, fields: dict[str, Any]) -> Any:
    return await c.prefill.Submit(prefill_pb2.SubmitRequest(
        request_id="r-bad", total_tokens=100, max_wait_ms=1, **fields))


async def _decode(c: FulcrumClient, fields: dict[str, Any]) -> Any:
    return await c.decode.PlaceDecode(decode_pb2.PlaceDecodeRequest(
        request_id="r-bad", kv_tokens=100, **fields))


async def _vision(c: FulcrumClient, fields: dict[str, Any]) -> Any:
    return await c.vision.PlaceImages(vision_pb2.PlaceImagesRequest(
        request_id="r-bad", images=[vision_pb2.Image(width=32, height=32)], **fields))


CALLS: list[tuple[str, Call]] = [("Submit", _submit), ("PlaceDecode", _decode),
                                 ("PlaceImages", _vision)]
BAD: list[tuple[dict[str, Any], str]] = [
    ({"priority": 3}, "priority: must be in [-2, 2], got 3"),
    ({"priority": -3}, "priority: must be in [-2, 2], got -3"),
    ({"tenant": "t" * 9}, "tenant: must be at most 8 characters, got 9"),
    ({"tenant": "a\x00b"}, "tenant: must be printable"),
    ({"ttft_slo_ms": MAX_TTFT_SLO_MS + 1}, "ttft_slo_ms: must be in"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[m.split(":")[0] + str(i)
                                                          for i, (_, m) in enumerate(BAD)])
@pytest.mark.parametrize(("rpc", "call"), CALLS, ids=[n for n, _ in CALLS])
async def test_bad_class_field_is_invalid_argument_naming_it(
    rpc: str, call: Call, fields: dict[str, Any], message: str
) -> None:
    async with (running_server({"tenants": TENANTS}) as d,
                FulcrumClient(d.address, timeout_s=10.0) as c):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(c, fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc
        assert message in (err.value.details() or ""), err.value.details()
        field = message.split(":")[0]
        assert scrape(d)[("fulcrum_tenant_invalid_fields_total", (("field", field),))] >= 1
        tenancy = d.app.components["tenants"]
        assert isinstance(tenancy, Tenancy) and tenancy.table.tracked == 0  # nothing changed


def _tenant_labels(d: Daemon) -> set[str]:
    return {dict(labels)["tenant"] for (name, labels) in scrape(d)
            if name.startswith("fulcrum_tenant_") and "tenant" in dict(labels)}


async def test_tenant_past_max_tenants_is_folded_and_counted() -> None:
    async with (running_server({"tenants": TENANTS}) as d,
                FulcrumClient(d.address, timeout_s=10.0) as c):
        # No decode GPU: each placement is refused after its class is resolved.
        for tenant in ("gold", "u1", "u2", "u3", "u4", "u1"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _decode(c, {"tenant": tenant, "priority": 1})
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        tenancy = d.app.components["tenants"]
        assert isinstance(tenancy, Tenancy)
        # max_tenants 3 = gold (configured) + u1 + u2; u3 and u4 fold; u1 again is known
        assert tenancy.table.tracked == 2
        assert tenancy.table.folded == 2
        samples = scrape(d)
        assert samples[("fulcrum_tenant_folded_total", ())] >= 2
        assert samples[("fulcrum_tenants_tracked", ())] == 2
        assert tenancy.table.tenant_of("u3") == "default"
        # (the registry is process-wide: other tests' configured names may be there)
        assert not _tenant_labels(d) & {"u1", "u2", "u3", "u4"}
