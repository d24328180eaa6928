"""Settings of the daemon itself: listening addresses, limits, drain, logs, fleet.

Keys are reloadable (SIGHUP) unless marked ``restart_only`` (see :data:`RESTART_ONLY`):
listening addresses, the gRPC transport's options and the random seed are fixed when the
daemon starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fulcrum.config.base import RESTART_ONLY, Section, message_bytes


class AdmissionSettings(Section):
    """Admission control: calls beyond a bound are answered at once, RESOURCE_EXHAUSTED
    with a ``retry-after-ms`` trailer, before gRPC's transport would time them out.

    Method classes: ``control`` (fleet Register/Heartbeat/Deregister, prefill Pull,
    ReportStepTimes and GetCostModel, EPLB group calls, releases, Ping), ``placement``
    (prefill Submit, PlaceDecode, PlaceImages and their streams) and ``admin``
    (ListMembers, Rebalance, GetGroupStatus). Health checks and reflection are never
    refused."""

    enabled: bool = Field(True, description="refuse calls beyond the bounds below")
    max_control: int = Field(
        4096, ge=1, le=1 << 20, description="concurrent calls of the control class"
    )
    max_placement: int = Field(
        1024, ge=1, le=1 << 20, description="concurrent calls of the placement class"
    )
    max_admin: int = Field(64, ge=1, le=1 << 20, description="concurrent calls of the admin class")
    shed_wait_ms: float = Field(
        500.0,
        gt=0,
        le=60_000,
        description="while a call has waited longer than this between its arrival and its "
        "handler (ms), or the event loop runs this late, new placement calls are refused on "
        "arrival; control calls keep going",
    )
    retry_after_ms: int = Field(
        100, ge=1, le=600_000, description="retry hint sent with a refusal, ms (at least)"
    )


class ServerSettings(Section):
    """The gRPC server."""

    host: str = Field(
        "127.0.0.1", min_length=1, description="gRPC listen address",
        json_schema_extra=RESTART_ONLY,
    )
    port: int = Field(
        50051, ge=0, le=65535, description="gRPC port (0 = any free port)",
        json_schema_extra=RESTART_ONLY,
    )
    grace_period_s: float = Field(
        10.0, gt=0, le=600, description="drain: time calls in flight get to finish, seconds"
    )
    drain_linger_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="drain: after the last call in flight ends, keep refusing new calls with "
        "UNAVAILABLE (so clients retry elsewhere) this long before closing, seconds",
    )
    max_message_bytes: int = message_bytes(
        "largest message, bytes: a larger request is answered RESOURCE_EXHAUSTED "
        "with a retry-after-ms trailer, up to twice this size (beyond that gRPC itself "
        "refuses it, RESOURCE_EXHAUSTED without the trailer)",
        json_schema_extra=RESTART_ONLY,
    )
    max_concurrent_streams: int = Field(
        1024, ge=1, le=1 << 20, description="concurrent HTTP/2 streams per connection",
        json_schema_extra=RESTART_ONLY,
    )
    max_call_s: float = Field(
        60.0, gt=0, le=3600, description="longest any unary call may run, seconds"
    )
    seed: int | None = Field(
        None, ge=0, description="seed of the random source (null = from the OS)",
        json_schema_extra=RESTART_ONLY,
    )
    loop_lag_probe_ms: int = Field(
        50, ge=1, le=1000,
        description="period of the event-loop lag probe (fulcrum_event_loop_lag_seconds and "
        "the admission's loop lateness), ms: a stall longer than this always shows; each "
        "wake-up costs CPU (about 0.1 ms on a small VM)",
        json_schema_extra=RESTART_ONLY,
    )
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)


class MetricsSettings(Section):
    """The Prometheus metrics HTTP endpoint."""

    enabled: bool = Field(True, description="serve /metrics", json_schema_extra=RESTART_ONLY)
    host: str = Field(
        "127.0.0.1", min_length=1, description="metrics listen address",
        json_schema_extra=RESTART_ONLY,
    )
    port: int = Field(
        9464, ge=0, le=65535, description="metrics port (0 = any free port)",
        json_schema_extra=RESTART_ONLY,
    )


class LoggingSettings(Section):
    """structlog output."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="level")
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto = JSON unless stdout is a terminal"
    )
    refusal_summary_interval_s: float = Field(
        10.0, ge=0.1, le=3600.0,
        description="refused calls are summarised at info at most once per this interval",
    )


class FleetSettings(Section):
    """Fleet membership: heartbeats and bounds."""

    heartbeat_interval_ms: int = Field(1000, ge=10, le=600_000, description="advised interval")
    heartbeat_timeout_ms: int = Field(
        5000, ge=20, le=3_600_000, description="lapse after which a member leaves placement"
    )
    sweep_interval_ms: int = Field(250, ge=5, le=60_000, description="lapse check period")
    max_members: int = Field(4096, ge=1, le=1_000_000, description="members of all kinds")
    max_gpus_per_member: int = Field(
        1024, ge=1, le=65536, description="GPUs (or DP ranks) of one member"
    )
