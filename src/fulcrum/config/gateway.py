"""Settings of the gateway endpoint picker (Envoy ext_proc, Gateway API Inference Extension).

Off by default. When on, the daemon serves ``envoy.service.ext_proc.v3.ExternalProcessor``
on ``port`` and gRPC health (``liveness``, ``readiness`` and the ext_proc service name) on
``health_port``. Endpoints come from the static ``pool`` (one entry per engine, one port
per DP rank: the inference extension maps DP rank = port); the daemon keeps them in the
fleet on their behalf and, when ``scrape.enabled``, corrects their load from their
Prometheus endpoints.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from fulcrum.config.base import Section, message_bytes
from fulcrum.config.cache import CacheSettings
from fulcrum.config.tenancy import GatewayTenancySettings

_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class PoolEngine(Section):
    """One model server (an engine): its address and one port per DP rank."""

    id: str = Field(..., description="fleet member id of the engine ([A-Za-z0-9._:-]{1,128})")
    host: str = Field(..., description="IP address the gateway sends requests to")
    ports: list[int] = Field(
        ...,
        min_length=1,
        max_length=1024,
        description="serving port of each DP rank, in rank order (DP rank = port)",
    )
    max_concurrency: int = Field(
        256, ge=1, le=1_000_000, description="requests one DP rank may hold, requests"
    )
    max_kv_tokens: int = Field(
        1_000_000, ge=1, le=(1 << 40) - 1, description="KV cache of one DP rank, tokens"
    )
    metrics_path: str = Field(
        "/metrics",
        pattern=r"^/[\x21-\x7e]*$",
        description="Prometheus path scraped on each rank's port (scrape.enabled)",
    )

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not _ID_RE.match(value):
            raise ValueError("must match [A-Za-z0-9._:-]{1,128}")
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError("must be an IP address (ORIGINAL_DST routes to IP:port)") from None
        return value

    @field_validator("ports")
    @classmethod
    def _ports(cls, value: list[int]) -> list[int]:
        for p in value:
            if not 1 <= p <= 65535:
                raise ValueError(f"port {p} must be in [1, 65535]")
        if len(set(value)) != len(value):
            raise ValueError("ports must be distinct")
        return value

    def addresses(self) -> list[str]:
        """``ip:port`` of each DP rank (IPv6 in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return [f"{host}:{p}" for p in self.ports]


class PoolSettings(Section):
    """Static pool: engines the gateway may route to."""

    decode: list[PoolEngine] = Field(
        default_factory=list,
        max_length=4096,
        description="decode engines (the picked endpoint is a decode DP rank)",
        json_schema_extra={"restart_only": True},
    )
    prefill: list[PoolEngine] = Field(
        default_factory=list,
        max_length=4096,
        description="prefill engines (P/D: their rank goes in x-prefiller-host-port; "
        "max_concurrency and max_kv_tokens unused)",
        json_schema_extra={"restart_only": True},
    )

    @model_validator(mode="after")
    def _unique(self) -> PoolSettings:
        for name, engines in (("decode", self.decode), ("prefill", self.prefill)):
            addrs = [a for e in engines for a in e.addresses()]
            if len(set(addrs)) != len(addrs):
                raise ValueError(f"{name}: an ip:port appears twice")
        ids = [e.id for e in (*self.decode, *self.prefill)]
        if len(set(ids)) != len(ids):
            raise ValueError("engine ids must be distinct across decode and prefill")
        return self


class PrefillProxySettings(Section):
    """P/D: how the daemon pulls on behalf of the pool's prefill engines."""

    wait_ms: int = Field(
        2000,
        ge=1,
        le=600_000,
        description="longest a request waits for a prefill engine before 429, ms "
        "(keep it under Envoy's ext_proc message_timeout)",
    )
    pull_wait_ms: int = Field(
        50, ge=1, le=10_000, description="long poll of one pull made on an engine's behalf, ms"
    )
    queue_steps: int = Field(
        4,
        ge=1,
        le=10_000,
        description="an engine may have this many steps (prefill.step_quota_ns each, per "
        "rank) of predicted work outstanding; remaining quota = that minus its load",
    )


class ScrapeSettings(Section):
    """Correct the load view from the engines' own Prometheus metrics."""

    enabled: bool = Field(
        False,
        description="scrape every pool engine's ranks",
        json_schema_extra={"restart_only": True},
    )
    interval_ms: int = Field(1000, ge=50, le=600_000, description="scrape period, ms")
    timeout_ms: int = Field(500, ge=10, le=60_000, description="per-scrape HTTP timeout, ms")


class GatewaySettings(Section):
    """The endpoint picker (EPP) for Envoy-based gateways."""

    enabled: bool = Field(
        False,
        description="serve the ext_proc endpoint picker",
        json_schema_extra={"restart_only": True},
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="EPP listen address",
        json_schema_extra={"restart_only": True},
    )
    port: int = Field(
        9002,
        ge=0,
        le=65535,
        description="ext_proc gRPC port (0 = any free port)",
        json_schema_extra={"restart_only": True},
    )
    health_port: int = Field(
        9003,
        ge=0,
        le=65535,
        description="gRPC health port: liveness, readiness, ext_proc service (0 = any)",
        json_schema_extra={"restart_only": True},
    )
    authz_http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="port of the HTTP picker (Envoy's ext_authz http_service, one "
        "HTTP/1.1 request per pick; null = off, 0 = any free port)",
        json_schema_extra={"restart_only": True},
    )
    chars_per_token: float = Field(
        4.0,
        gt=0.0,
        le=64.0,
        description="prompt length estimate: characters per token (no tokenizer configured)",
    )
    tokenizer: str | None = Field(
        None,
        description="path of a tokenizer.json (needs the `tokenizers` package) to count "
        "prompt tokens exactly; null = characters / chars_per_token",
        json_schema_extra={"restart_only": True},
    )
    default_max_tokens: int = Field(
        256,
        ge=1,
        le=(1 << 32),
        description="output length assumed when a request sets no max_tokens, tokens",
    )
    fallbacks: int = Field(
        0,
        ge=0,
        le=16,
        description="fallback endpoints listed after the primary in "
        "x-gateway-destination-endpoint (0 = primary only; Envoy's ORIGINAL_DST "
        "cluster reads a single address)",
    )
    max_in_flight: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="HTTP requests held by the picker at once; beyond it: 429",
    )
    max_body_bytes: int = message_bytes("largest request body read; bigger: 413, bytes")
    retry_after_s: int = Field(
        1, ge=0, le=3600, description="retry-after header of a 429 answer, seconds"
    )
    max_streams: int = Field(
        8192,
        ge=1,
        le=1_000_000,
        description="ext_proc streams open at once (one per HTTP request in the gateway); "
        "a stream beyond it is answered 429 at its first message",
    )
    max_pending_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        le=1 << 36,
        description="request body bytes held by all streams still assembling a body; "
        "a chunk beyond it: 429, bytes",
    )
    max_body_ms: int = Field(
        60_000,
        ge=1,
        le=3_600_000,
        description="longest time from a stream's opening to its complete request "
        "(headers, body, trailers); beyond it: 503 and the stream ends, ms",
    )
    max_hold_s: float = Field(
        3600.0,
        gt=0.0,
        le=7 * 86400.0,
        description="unary mode (ext_authz + access log): longest a placement is held "
        "without its access-log entry; then it is released (reason expired), s",
    )
    pool: PoolSettings = Field(
        default_factory=PoolSettings,
        description="static pool (restart-only: its engines are registered at start)",
    )
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    prefill: PrefillProxySettings = Field(default_factory=PrefillProxySettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    tenancy: GatewayTenancySettings = Field(default_factory=GatewayTenancySettings)
    subset_namespace: str = Field(
        "envoy.lb.subset_hint",
        min_length=1,
        description="filter-metadata namespace of the subset hint",
    )
    metadata_namespace: str = Field(
        "envoy.lb", min_length=1, description="dynamic-metadata namespace of the answer"
    )
    engine_kind: Literal["auto", "vllm", "sglang"] = Field(
        "auto", description="metric names to scrape: vllm:*, sglang:* or whichever is present"
    )
