"""The daemon's Prometheus registry and the collectors of the service shell.

Every balancer declares its own collectors in ``fulcrum.metrics.<balancer>`` on
:data:`REGISTRY`; nothing registers on prometheus_client's global default registry, so
several daemons (in tests) can live in one process only if they share these collectors:
values are process-wide, as they are in production where one process is one daemon.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

#: Latency buckets for RPCs, seconds: 50 us to 30 s.
RPC_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)

RPC_REQUESTS = Counter(
    "fulcrum_rpc_requests",
    "gRPC calls handled, by service, method and final status code.",
    ["service", "method", "code"],
    registry=REGISTRY,
)
RPC_DURATION = Histogram(
    "fulcrum_rpc_duration_seconds",
    "Wall time of gRPC calls from handler start to final status, seconds.",
    ["service", "method"],
    buckets=RPC_BUCKETS,
    registry=REGISTRY,
)
RPC_IN_FLIGHT = Gauge(
    "fulcrum_rpc_in_flight",
    "gRPC calls currently being handled.",
    registry=REGISTRY,
)
STREAM_MESSAGES = Counter(
    "fulcrum_rpc_stream_messages_received",
    "Messages received on client-streaming or bidirectional calls.",
    ["service", "method"],
    registry=REGISTRY,
)
BUILD_INFO = Gauge(
    "fulcrum_build_info",
    "Constant 1, labelled with the version.",
    ["version"],
    registry=REGISTRY,
)
DRAINING = Gauge(
    "fulcrum_draining",
    "1 while the daemon drains after SIGTERM/SIGINT, else 0.",
    registry=REGISTRY,
)
FLEET_MEMBERS = Gauge(
    "fulcrum_fleet_members",
    "Live fleet members, by kind.",
    ["kind"],
    registry=REGISTRY,
)
FLEET_EVENTS = Counter(
    "fulcrum_fleet_events",
    "Fleet membership changes, by kind and event (joined, rejoined, left, lapsed).",
    ["kind", "event"],
    registry=REGISTRY,
)
CONFIG_RELOADS = Counter(
    "fulcrum_config_reloads",
    "Configuration reloads (SIGHUP), by outcome: applied (every key of the file is in "
    "effect), restart_required (reloadable keys applied; restart-only keys changed in the "
    "file kept their running values), refused (invalid file: nothing changed), failed (a "
    "reload hook raised; see the log).",
    ["outcome"],
    registry=REGISTRY,
)
CONFIG_RESTART_REQUIRED = Gauge(
    "fulcrum_config_restart_required",
    "1 while the configuration file changes restart-only keys that the running daemon "
    "still holds at their old values (see the log event config_restart_required), else 0.",
    registry=REGISTRY,
)
RPC_SHED = Counter(
    "fulcrum_rpc_shed",
    "Calls refused by admission control (RESOURCE_EXHAUSTED with retry-after-ms), by "
    "method class (control, placement, admin) and reason (queue_wait, abandoned, loop_lag, "
    "concurrency).",
    ["class", "reason"],
    registry=REGISTRY,
)
