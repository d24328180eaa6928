"""The daemon shell over real gRPC on loopback: health, reflection, metrics, errors."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.client import FulcrumClient, check_health
from fulcrum.service.server import Daemon
from fulcrum.v1 import diagnostics_pb2

FULCRUM_SERVICES = {
    "fulcrum.v1.DiagnosticsService",
    "fulcrum.v1.FleetService",
    "fulcrum.v1.PrefillBalancerService",
    "fulcrum.v1.DecodeBalancerService",
    "fulcrum.v1.VisionBalancerService",
    "fulcrum.v1.ExpertBalancerService",
}


def scrape(daemon: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse /metrics with prometheus_client's parser into {(sample, labels): value}."""
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_health_serving_for_every_service(daemon: Daemon, client: FulcrumClient) -> None:
    for name in ["", *sorted(FULCRUM_SERVICES)]:
        reply = await client.health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    assert await check_health(daemon.address) == "SERVING"


async def test_health_unknown_service_is_not_found(client: FulcrumClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.health.Check(health_pb2.HealthCheckRequest(service="nope.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_every_service(client: FulcrumClient) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)

    async def requests():  # type: ignore[no-untyped-def]
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names = set()
    async for reply in stub.ServerReflectionInfo(requests()):
        names |= {s.name for s in reply.list_services_response.service}
    assert names >= FULCRUM_SERVICES | {"grpc.health.v1.Health"}


async def test_metrics_scrape_parses_and_call_counter_moves(
    daemon: Daemon, client: FulcrumClient
) -> None:
    key = (
        "fulcrum_rpc_requests_total",
        (("code", "OK"), ("method", "Ping"), ("service", "DiagnosticsService")),
    )
    before = scrape(daemon).get(key, 0.0)
    for _ in range(3):
        await client.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"x"))
    after = scrape(daemon)
    assert after[key] == before + 3
    assert ("process_resident_memory_bytes", ()) in after
    hist = (
        "fulcrum_rpc_duration_seconds_count",
        (("method", "Ping"), ("service", "DiagnosticsService")),
    )
    assert after[hist] >= 3


async def test_error_codes_are_counted(daemon: Daemon, client: FulcrumClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.diagnostics.Ping(diagnostics_pb2.PingRequest(delay_ms=61_000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "delay_ms" in (err.value.details() or "")
    key = (
        "fulcrum_rpc_requests_total",
        (("code", "INVALID_ARGUMENT"), ("method", "Ping"), ("service", "DiagnosticsService")),
    )
    assert scrape(daemon)[key] >= 1


async def test_ping_stream_echoes_in_order(client: FulcrumClient) -> None:
    async def requests():  # type: ignore[no-untyped-def]
        for i in range(50):
            yield diagnostics_pb2.PingStreamRequest(payload=str(i).encode())

    got = [r.payload async for r in client.diagnostics.PingStream(requests())]
    assert got == [str(i).encode() for i in range(50)]


async def test_drain_turns_health_not_serving_and_finishes_call_in_flight(
    daemon: Daemon, client: FulcrumClient
) -> None:
    slow = asyncio.ensure_future(
        client.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"slow", delay_ms=400))
    )
    # Wait until the call is in flight (a bounded poll on a condition, not a sleep).
    for _ in range(1000):
        if daemon.app.in_flight:
            break
        await asyncio.sleep(0.001)
    assert daemon.app.in_flight == 1
    stopping = asyncio.ensure_future(daemon.drain_and_stop())
    for _ in range(1000):
        if daemon.app.draining.is_set():
            break
        await asyncio.sleep(0.001)
    reply = await client.health.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.diagnostics.Ping(diagnostics_pb2.PingRequest(), timeout=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (await slow).payload == b"slow"
    await stopping


async def test_drain_closes_open_streams_with_unavailable(
    daemon: Daemon, client: FulcrumClient
) -> None:
    call = client.diagnostics.PingStream()
    await call.write(diagnostics_pb2.PingStreamRequest(payload=b"1"))
    assert (await call.read()).payload == b"1"
    await daemon.drain_and_stop()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
