"""Server lifecycle: build the grpc.aio server with every service, health checking and
reflection; serve metrics; drain on SIGTERM/SIGINT; reload on SIGHUP.

Reload (:meth:`Daemon.reload`): a file that names no setting (empty, only comments) is
refused and changes nothing. Otherwise the new settings run with every restart-only key (marked
``json_schema_extra={"restart_only": True}`` in the settings models) at its running
value; the restart-only keys the file changed are logged by name (event
``config_restart_required``) and the reload is counted as
``fulcrum_config_reloads_total{outcome="restart_required"}`` (``applied`` when nothing
needs a restart). Then every hook in ``app.reload_hooks`` is called with the effective
settings, in registration order.

Drain, in order: health turns NOT_SERVING for every service, new calls are refused with
UNAVAILABLE (health checks still answer), streams are closed with UNAVAILABLE, calls in
flight get up to ``server.grace_period_s`` to finish, then the server stops.

Health names: every service and ``""``. With ``ha.backend`` other than ``none``
(:mod:`fulcrum.ha.runtime`) also ``readiness`` and ``liveness``, and all but ``liveness``
follow the leadership: a standby is NOT_SERVING there and SERVING on ``liveness``; a drain resigns
the leadership first (a standby takes over at once), which closes the calls in flight
with UNAVAILABLE at once instead of giving them ``grace_period_s``: past the resignation
another daemon leads. Without HA nothing of it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from fulcrum import __version__, logs
from fulcrum.config import ConfigError, Settings, effective_reload, is_empty_document
from fulcrum.metrics import (
    BUILD_INFO,
    CONFIG_RELOADS,
    CONFIG_RESTART_REQUIRED,
    DRAINING,
    REGISTRY,
)
from fulcrum.metrics.ha import LEADER as HA_LEADER
from fulcrum.service import (
    authz,
    decode,
    diagnostics,
    eplb,
    fleet,
    looplag,
    prefill,
    transport,
    vision,
)
from fulcrum.service.admission import Admission
from fulcrum.service.app import App
from fulcrum.service.interceptors import ShellInterceptor
from fulcrum.v1 import descriptors

log = structlog.get_logger(__name__)

#: Every service module: ``register(server, app) -> list[str]`` of full service names.
SERVICE_MODULES: tuple[ModuleType, ...] = (diagnostics, fleet, prefill, decode, vision, eplb)


@dataclass
class Daemon:
    """A built (and, after :meth:`start`, running) daemon."""

    app: App
    server: grpc.aio.Server
    health: HealthServicer
    services: list[str]
    port: int = 0
    metrics_port: int = 0
    _metrics_server: Any = None
    gateway: Any = None  # fulcrum.gateway.server.Gateway when gateway.enabled
    ha: Any = None  # fulcrum.ha.runtime.Ha when ha.backend is not none
    #: Exit status of ``fulcrum serve`` (1 after a lost leadership).
    exit_code: int = 0
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _drain_task: Any = None

    @property
    def address(self) -> str:
        return f"{self.app.settings.server.host}:{self.port}"

    def reload(self, new: Settings) -> str:
        """Apply reloaded settings (see the module docstring); returns the outcome
        (``applied``, ``restart_required``, ``refused`` or ``failed``), also counted in
        ``fulcrum_config_reloads_total``. Runs on the event loop."""
        app = self.app
        if is_empty_document(new):
            CONFIG_RELOADS.labels("refused").inc()
            log.error("config_reload_refused", problems=[
                "the file names no setting (empty or only comments): a reload of it would "
                "put every key back to its default; nothing was changed"])
            return "refused"
        try:
            effective, restart = effective_reload(app.settings, new)
        except ConfigError as err:
            CONFIG_RELOADS.labels("refused").inc()
            log.error("config_reload_refused", problems=err.problems)
            return "refused"
        app.settings = effective
        failed = []
        for hook in app.reload_hooks:
            try:
                hook(effective)
            except Exception:
                log.exception("reload_hook_failed", hook=getattr(hook, "__qualname__", "?"))
                failed.append(getattr(hook, "__qualname__", "?"))
        CONFIG_RESTART_REQUIRED.set(1 if restart else 0)
        if failed:
            outcome = "failed"
        elif restart:
            outcome = "restart_required"
            log.warning("config_restart_required", keys=restart,
                        hint="these keys keep their running values until a restart")
        else:
            outcome = "applied"
        CONFIG_RELOADS.labels(outcome).inc()
        log.info("config_reloaded", outcome=outcome, restart_required=restart)
        return outcome

    async def start(self) -> None:
        await self.server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        if self.ha is None:
            for name in [*self.services, ""]:
                await self.health.set(name, serving)
            HA_LEADER.set(1)  # alone: always the leader
        else:  # standby until elected (fulcrum.ha.runtime)
            for name in [*self.services, "", "readiness"]:
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.health.set("liveness", serving)
            self.app.spawn(self.ha.elector.run(), "ha-elector")
        m = self.app.settings.metrics
        if m.enabled:
            from prometheus_client import start_http_server

            self._metrics_server, _ = start_http_server(m.port, addr=m.host, registry=REGISTRY)
            self.metrics_port = self._metrics_server.server_port
        if self.gateway is not None:
            await self.gateway.start()
        BUILD_INFO.labels(__version__).set(1)
        DRAINING.set(0)
        log.info(
            "daemon_started",
            address=self.address,
            metrics_port=self.metrics_port,
            services=len(self.services),
            version=__version__,
        )

    async def drain_and_stop(self) -> None:
        """Graceful shutdown (see the module docstring). Idempotent."""
        if self._stopped.is_set():
            return
        grace = self.app.settings.server.grace_period_s
        log.info("daemon_draining", in_flight=self.app.in_flight, grace_period_s=grace)
        DRAINING.set(1)
        if self.ha is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ha.resign(), timeout=grace)
        await self.health.enter_graceful_shutdown()
        self.app.start_draining()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        try:
            await asyncio.wait_for(self.app.wait_idle(), timeout=grace)
        except TimeoutError:
            log.warning("drain_grace_expired", in_flight=self.app.in_flight)
        linger = min(self.app.settings.server.drain_linger_s, deadline - loop.time())
        if linger > 0:
            # Calls arriving now still get a clean UNAVAILABLE from the interceptor;
            # once the server stops they would be cancelled by the transport instead.
            await asyncio.sleep(linger)
        if self.gateway is not None:
            await self.gateway.stop(max(0.0, deadline - loop.time()))
        await self.server.stop(max(0.0, deadline - loop.time()))
        await self.app.stop_tasks()
        if self._metrics_server is not None:
            # socketserver's shutdown() waits out a 0.5 s poll: do it off the event loop.
            srv = self._metrics_server
            threading.Thread(
                target=lambda: (srv.shutdown(), srv.server_close()), daemon=True
            ).start()
        self._stopped.set()
        log.info("daemon_stopped")

    def stop_with(self, code: int) -> None:
        """Drain and stop; ``fulcrum serve`` then exits with ``code``."""
        self.exit_code = code
        self._drain_task = asyncio.ensure_future(self.drain_and_stop())

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def build(settings: Settings, app: App | None = None) -> Daemon:
    """Build the server and every service (not started). Must run inside an event loop."""
    app = app or App.create(settings)
    s = settings.server
    options = [
        ("grpc.max_send_message_length", s.max_message_bytes),
        # Twice the bound: a message up to that size reaches the guard interceptor, which
        # answers RESOURCE_EXHAUSTED with a retry-after-ms trailer (see service.authz).
        ("grpc.max_receive_message_length", min(2 * s.max_message_bytes, (1 << 31) - 1)),
        ("grpc.max_concurrent_streams", s.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
    ]
    admission = Admission(s.admission)
    app.components["admission"] = admission
    app.reload_hooks.append(lambda new: admission.apply_settings(new.server.admission))
    app.reload_hooks.append(_reload_logging(settings))
    interceptors = [*authz.interceptors(settings, app), ShellInterceptor(app, admission)]
    ha = None
    if settings.ha.enabled:
        from fulcrum.ha.runtime import Ha

        ha = Ha(settings)  # fulcrum.ha.tls.TlsError names the file and the reason
        interceptors.insert(0, ha.interceptor())  # outermost: a standby refuses first
    server = grpc.aio.server(interceptors=interceptors, options=options)
    names: list[str] = []
    for module in SERVICE_MODULES:
        names.extend(module.register(server, app))
    looplag.start(app)  # fulcrum_event_loop_lag_seconds
    health = Health()
    health.gate = None if ha is None else ha.gate
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection(
        [*names, health_name, reflection.SERVICE_NAME], server, pool=descriptors.commented_pool()
    )
    port = transport.add_port(server, settings, app)
    from fulcrum.gateway import server as gateway_server

    gw = gateway_server.build(app)
    daemon = Daemon(app=app, server=server, health=health, services=names, port=port,
                    gateway=gw, ha=ha)
    if ha is not None:
        ha.bind(health, names, daemon.address, app.components.get("eplb"),
                app.components.get("prefill"))
        ha.stop = daemon.stop_with
    return daemon


def _reload_logging(settings: Settings) -> Callable[[Settings], None]:
    """A reload hook that reconfigures structlog when ``logging`` changed."""
    current = [settings.logging]

    def hook(new: Settings) -> None:
        if new.logging != current[0]:
            current[0] = new.logging
            logs.configure(new.logging.level, new.logging.format)
            log.info("logging_reconfigured", level=new.logging.level, format=new.logging.format)

    return hook


class Health(HealthServicer):  # type: ignore[misc]
    """grpc.health.v1.Health with ``List`` (grpcio-health-checking's asyncio servicer
    leaves it unimplemented): every registered service and its status. With HA,
    ``Check`` also reads the gate itself, so a daemon whose lease deadline passed answers
    NOT_SERVING even before the timer that closes the gate has run (a thawed process)."""

    gate: Any = None  # fulcrum.ha.gate.Gate with an HA backend

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        gate = self.gate
        if (gate is not None and request.service != "liveness" and not gate.ok()
                and request.service in self._server_status):
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return await super().Check(request, context)

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in sorted(self._server_status.items())
            }
        )


def install_signal_handlers(
    daemon: Daemon, reload: Callable[[], None] | None = None
) -> None:
    """SIGTERM/SIGINT drain and stop; SIGHUP calls ``reload``."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(daemon.drain_and_stop()))
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, reload)


class EarlySignals:
    """Signal handlers installed before anything is built or bound: a SIGHUP or a stop
    signal that arrives while the daemon is still starting is remembered (a SIGHUP's
    default action would kill the process) and replayed once it has started."""

    def __init__(self) -> None:
        self.stop = False
        self.hup = False
        self.drain: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)

    def _on_stop(self) -> None:
        self.stop = True

    def _on_hup(self) -> None:
        self.hup = True
        log.info("config_reload_deferred", reason="the daemon is still starting")

    def hand_over(self, daemon: Daemon, reload: Callable[[], None] | None) -> None:
        """Install the daemon's own handlers, then replay what arrived meanwhile."""
        install_signal_handlers(daemon, reload)
        if self.hup and reload is not None:
            reload()
        if self.stop:  # not app.spawn: the drain cancels the app's tasks
            self.drain = asyncio.ensure_future(daemon.drain_and_stop())


async def serve(settings: Settings, reload: Callable[[Daemon], None] | None = None) -> int:
    """Run the daemon until a stop signal; returns the exit status."""
    # Handlers first, before any port is bound: a SIGHUP the moment the port accepts TCP
    # must not kill the process (issue 22). "daemon_started" still tells operators that
    # a SIGHUP reloads at once.
    early = EarlySignals()
    try:
        daemon = build(settings)
    except ValueError as err:
        from fulcrum.ha.tls import TlsError

        if not isinstance(err, TlsError):
            raise
        log.error("ha_etcd_tls_invalid", problem=str(err))
        return 2
    await daemon.start()
    early.hand_over(daemon, (lambda: reload(daemon)) if reload else None)
    # Everything allocated so far (modules, gRPC, prometheus_client, the servicers) lives
    # as long as the process: move it out of the collector's generations, so a full
    # collection on the loop costs the tables' objects only (46 ms -> 0.01 ms for an
    # empty daemon; measured by benchmarks/bench_scale.py's loop-lag probe).
    gc.freeze()
    # Load shedding on the loop's lateness, from the loop-lag probe: one probe
    # measures the lateness for both (the histogram and the shedding).
    daemon.app.components["admission"].watch(daemon.app.components["loop_lag"])
    await daemon.wait_stopped()
    return daemon.exit_code
