"""The picker's servers in the daemon: ext_proc on ``gateway.port``, gRPC health on
``gateway.health_port``; the static pool's keep-alive and the optional scraper.

Health services (proposal 004): ``liveness`` (SERVING while the process answers),
``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` (SERVING once the pool is
registered and the ext_proc server listens; NOT_SERVING while draining), and ``""``.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from fulcrum.config import Settings
from fulcrum.config.gateway import GatewaySettings
from fulcrum.gateway import authz, authz_http
from fulcrum.gateway.adapter import DecodeAdapter, PrefillAdapter
from fulcrum.gateway.body import load_tokenizer
from fulcrum.gateway.extproc import SERVICE, Picker, add_to_server
from fulcrum.gateway.kv_events import subscribe
from fulcrum.gateway.pool import StaticPool
from fulcrum.gateway.prefill import PrefillProxy
from fulcrum.gateway.scrape import Scraper
from fulcrum.service.tenants import tenancy_of
from fulcrum.state.decode import DecodeState

log = structlog.get_logger(__name__)

HEALTH_SERVICES = ("liveness", "readiness", SERVICE, "")


@dataclass
class Gateway:
    """A built (and, after :meth:`start`, running) endpoint picker."""

    app: Any
    picker: Picker
    pool: StaticPool
    server: grpc.aio.Server
    health_server: grpc.aio.Server
    health: HealthServicer
    port: int
    health_port: int
    scraper: Scraper | None = None
    #: The unary mode's access-log servicer (its lease table; ended first at stop).
    access_log: authz.AccessLogServicer | None = None
    #: The ZMQ endpoint bound for vLLM's KV events ("" when off or it failed).
    kv_endpoint: str = ""
    #: The HTTP picker (``gateway.authz_http_port``), its server and bound port (0: off).
    authz_http: authz_http.AuthzHttp | None = None
    http_server: asyncio.Server | None = None
    http_port: int = 0
    _started: bool = field(default=False)
    _drain_task: asyncio.Future[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.app.settings.gateway.host}:{self.port}"

    async def start(self) -> None:
        app = self.app
        now = app.clock()
        # The scrape asks the loop for the picker's counts (built then, not per request).
        schedule = asyncio.get_running_loop().call_soon_threadsafe
        self.picker.counts.publisher.set_schedule(schedule)
        if self.picker.cache is not None:
            self.picker.cache.counts.publisher.set_schedule(schedule)
        self.pool.start(now)
        interval = app.settings.fleet.heartbeat_timeout_ms / 2000
        app.every(interval, self.pool.keep_alive, "gateway-pool-keepalive")
        prefill = self.picker.prefill
        if prefill is not None:
            prefill.start(now)
            app.every(interval, prefill.keep_alive, "gateway-prefill-keepalive")
        if self.scraper is not None:
            app.spawn(self.scraper.run(), "gateway-scrape")
        await self._start_kv_events()
        await self.health_server.start()
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        await self._start_http()
        for name in ("readiness", SERVICE, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._started = True
        app.drain_hooks.append(self._on_drain)
        log.info(
            "gateway_started",
            address=self.address,
            health_port=self.health_port,
            endpoints=len(self.pool.addresses),
            policy=self.picker.adapter.policy_name,
        )

    async def _start_http(self) -> None:
        """gateway.authz_http_port: the HTTP picker's listener."""
        gs = self.app.settings.gateway
        if self.authz_http is None or gs.authz_http_port is None:
            return
        self.http_server, self.http_port = await authz_http.serve(
            self.authz_http, gs.host, gs.authz_http_port)
        _warn_if_plaintext(gs.host, self.http_port)
        log.info("gateway_authz_http_started", port=self.http_port)

    async def _start_kv_events(self) -> None:
        """gateway.cache.kv_events: the subscriber task (a failed bind is logged; the picks
        stay approximate)."""
        ks = self.app.settings.gateway.cache.kv_events
        cache = self.picker.cache
        if cache is None or not ks.enabled:
            return
        bound: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.app.spawn(subscribe(ks.endpoint, cache.kv_sink(), bound), "gateway-kv-events")
        try:
            self.kv_endpoint = await bound
        except Exception:
            return
        log.info("gateway_kv_events_bound", endpoint=self.kv_endpoint)

    def _on_drain(self) -> None:
        """The daemon drains: the gateway should stop sending new requests here."""
        self._drain_task = asyncio.ensure_future(self._set_ready(False))

    async def _set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("readiness", SERVICE, ""):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Readiness NOT_SERVING, streams get ``grace_s`` to finish, then stop."""
        if not self._started:
            return
        self._started = False
        await self._set_ready(False)
        if self.access_log is not None:
            self.access_log.close()
        if self.http_server is not None:  # every connection closes (a pick under way: released)
            self.http_server.close()
            assert self.authz_http is not None
            self.authz_http.close_all()
            await self.http_server.wait_closed()
        await self.server.stop(grace_s)
        if self.picker.prefill is not None:
            await self.picker.prefill.stop(self.app.clock())
        self.pool.stop(self.app.clock())
        await self.health_server.stop(0)
        log.info("gateway_stopped")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _warn_if_plaintext(host: str, port: int) -> None:
    """A warning at start when the ext_proc port (always plaintext) is not loopback."""
    if _loopback(host):
        return
    log.warning(
        "gateway_listens_without_tls",
        host=host,
        port=port,
        hint="the ext_proc port has no TLS: anyone who reaches it can route requests "
        "and hold placements; keep it on loopback or a private network "
        "(docs/gateway-limits.md)",
    )


def _extproc_server(
    gs: GatewaySettings, picker: Picker, clock: Callable[[], int]
) -> tuple[grpc.aio.Server, int, authz.AccessLogServicer]:
    """The picker's server (ext_proc, and the unary mode's ext_authz and access log),
    bound (messages up to ``max_body_bytes`` + 1 MiB)."""
    options = [
        ("grpc.max_receive_message_length", gs.max_body_bytes + (1 << 20)),
        ("grpc.max_send_message_length", gs.max_body_bytes + (1 << 20)),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    add_to_server(server, picker)
    access_log = authz.add_to_server(server, picker, clock)
    port = server.add_insecure_port(f"{gs.host}:{gs.port}")
    _warn_if_plaintext(gs.host, port)
    return server, port, access_log


def build(app: Any) -> Gateway | None:
    """Build the picker from ``app.settings.gateway`` (None when it is off). Needs the
    decode balancer built first (``app.components["decode"]``)."""
    settings: Settings = app.settings
    gs = settings.gateway
    if not gs.enabled:
        return None
    state: DecodeState = app.components["decode"]
    pool = StaticPool(app.fleet, gs.pool.decode)
    adapter = DecodeAdapter(state, pool.addresses, app.components.get("serving_addresses"))
    pool.adapter = adapter
    counter = load_tokenizer(gs.tokenizer) if gs.tokenizer else None
    prefill = None
    if gs.pool.prefill:
        prefill = PrefillProxy(
            app.fleet,
            PrefillAdapter(app.components["prefill"]),
            gs.pool.prefill,
            gs,
            app.clock,
        )
    picker = Picker(
        gs,
        adapter,
        app.clock,
        lambda: int(state.settings.max_request_kv_tokens),
        counter,
        prefill,
    )
    app.components["gateway"] = picker
    picker.tenancy = tenancy_of(app)  # tenancy headers -> the daemon's classes (issue 23)

    def reload(new: Settings) -> None:
        picker.apply_settings(new.gateway)
        if prefill is not None:
            prefill.apply_settings(new.gateway)
        if scraper is not None:
            scraper.apply_settings(new.gateway)

    app.reload_hooks.append(reload)
    server, port, access_log = _extproc_server(gs, picker, app.clock)
    health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
    health_port = health_server.add_insecure_port(f"{gs.host}:{gs.health_port}")
    scraper = Scraper(gs, pool, app.clock) if gs.scrape.enabled else None
    return Gateway(
        app=app,
        picker=picker,
        pool=pool,
        server=server,
        health_server=health_server,
        health=health,
        port=port,
        health_port=health_port,
        scraper=scraper,
        access_log=access_log,
        authz_http=None if gs.authz_http_port is None
        else authz_http.AuthzHttp(picker, access_log.leases, app.clock),
    )
