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
from tests.polling import until

FULCRUM_SERVICES = {
    "fulcrum.v1.DiagnosticsService",
    "fulcrum.v1.FleetService",
    "fulcrum.v1.PrefillBalancerService",
    "fulcrum.v1.DecodeBalancerService",
    "fulcrum.v1.VisionBalancerService",
    "fulcrum.v1.ExpertBalancerService",
}


def scrape(daemon: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse /metrics with prometheus_client's parser into {(sample, labels): value}.
    The scrape blocks the daemon's loop (urlopen on it), so the loop could not build the
    tables' stale snapshots when the scrape thread asks: build them first."""
    for name in ("decode", "vision"):
        table = daemon.app.components.get(name)
        if table is not None:
            table.publisher.current()
    picker = daemon.app.components.get("gateway")
    if picker is not None:
        picker.counts.publisher.current()
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
    # The slow call keeps the drain open (test settings: no linger) while the new call
    # below is refused: 2 s, well inside the 5 s grace, so that a loaded machine cannot
    # end it before that call arrives (at 400 ms it once did: the server had stopped and
    # the new call was CANCELLED by the transport, not refused).
    slow = asyncio.ensure_future(
        client.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"slow", delay_ms=2000))
    )
    # Wait until the call is in flight (a bounded poll on a condition, not a sleep).
    await until(lambda: daemon.app.in_flight > 0, "the slow call in flight")
    assert daemon.app.in_flight == 1
    stopping = asyncio.ensure_future(daemon.drain_and_stop())
    await until(daemon.app.draining.is_set, "the daemon draining")
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


async def test_health_list_names_every_service(daemon: Daemon, client: FulcrumClient) -> None:
    """grpc.health.v1.Health/List answers (it was INTERNAL with a traceback)."""
    from grpc_health.v1 import health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(client.channel)
    reply = await stub.List(health_pb2.HealthListRequest())
    assert set(reply.statuses) == FULCRUM_SERVICES | {""}
    assert all(s.status == health_pb2.HealthCheckResponse.SERVING
               for s in reply.statuses.values())


# -- reload -----------------------------------------------------------------------------


def reloads(outcome: str) -> float:
    from fulcrum.metrics import REGISTRY

    return REGISTRY.get_sample_value("fulcrum_config_reloads_total", {"outcome": outcome}) or 0.0


async def test_reload_keeps_restart_only_keys_and_reports_them(daemon: Daemon) -> None:
    import structlog

    from fulcrum.config import with_overrides

    before = reloads("restart_required")
    new = with_overrides(daemon.app.settings, {
        "server": {"port": daemon.port + 1, "max_call_s": 7.0, "seed": 99},
        "fleet": {"heartbeat_timeout_ms": 700, "heartbeat_interval_ms": 100},
    })
    with structlog.testing.capture_logs() as logs:
        assert daemon.reload(new) == "restart_required"
    s = daemon.app.settings
    assert s.server.port == 0 and s.server.seed == 1234  # kept: restart-only
    assert s.server.max_call_s == 7.0 and s.fleet.heartbeat_timeout_ms == 700  # applied
    assert daemon.app.fleet.settings.heartbeat_timeout_ms == 700
    warn = next(e for e in logs if e["event"] == "config_restart_required")
    assert warn["keys"] == ["server.port", "server.seed"]
    assert reloads("restart_required") == before + 1
    from fulcrum.metrics import REGISTRY

    assert REGISTRY.get_sample_value("fulcrum_config_restart_required") == 1
    # the same file again, minus the restart-only changes: applied, nothing to restart
    before = reloads("applied")
    assert daemon.reload(with_overrides(s, {})) == "applied"
    assert reloads("applied") == before + 1
    assert REGISTRY.get_sample_value("fulcrum_config_restart_required") == 0


async def test_reloaded_fleet_timing_reaches_members(daemon: Daemon, client: FulcrumClient) -> None:
    from fulcrum.config import with_overrides
    from fulcrum.v1 import fleet_pb2

    new = with_overrides(daemon.app.settings, {
        "fleet": {"heartbeat_timeout_ms": 800, "heartbeat_interval_ms": 200}})
    assert daemon.reload(new) == "applied"
    reply = await client.fleet.Register(fleet_pb2.RegisterRequest(
        member_id="pf-1", prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=1)))
    assert (reply.heartbeat_interval_ms, reply.heartbeat_timeout_ms) == (200, 800)
    beat = await client.fleet.Heartbeat(
        fleet_pb2.HeartbeatRequest(member_id="pf-1", incarnation=reply.incarnation))
    assert beat.heartbeat_timeout_ms == 800


async def test_reloaded_max_call_s_caps_calls(daemon: Daemon, client: FulcrumClient) -> None:
    from fulcrum.config import with_overrides

    assert daemon.reload(
        with_overrides(daemon.app.settings, {"server": {"max_call_s": 0.05}})) == "applied"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.diagnostics.Ping(diagnostics_pb2.PingRequest(delay_ms=5_000))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "max_call_s=0.05" in (err.value.details() or "")


async def test_reload_refused_when_restart_only_values_make_it_invalid(daemon: Daemon) -> None:
    """plaintext stays true (restart-only); TLS files with plaintext are refused whole."""
    from fulcrum.config import Settings

    data = daemon.app.settings.model_dump()
    data["security"]["plaintext"] = False
    data["security"]["tls"] = {"cert_file": __file__, "key_file": __file__,
                               "client_ca_file": ""}
    new = Settings.model_validate(data)
    before = reloads("refused")
    assert daemon.reload(new) == "refused"
    assert reloads("refused") == before + 1
    assert daemon.app.settings.security.plaintext


def test_restart_only_keys_are_marked_in_the_models() -> None:
    from fulcrum.config import restart_only_keys

    keys = restart_only_keys()
    for key in ("server.host", "server.port", "server.max_message_bytes",
                "server.max_concurrent_streams", "server.seed", "metrics.port",
                "security.plaintext", "security.tls.client_ca_file"):
        assert key in keys
    for key in ("fleet.heartbeat_timeout_ms", "server.max_call_s", "server.grace_period_s",
                "security.tls.cert_file", "security.auth.enabled", "logging.level"):
        assert key not in keys
