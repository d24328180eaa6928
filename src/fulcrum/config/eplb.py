"""Settings of the expert-parallel load balancer (EPLB)."""

from __future__ import annotations

from pydantic import Field, field_validator

from fulcrum.config.base import Section
from fulcrum.core.eplb.registry import DEFAULT_ALGORITHM, REGISTRY


class EplbSettings(Section):
    """The EPLB: expert load statistics in, expert-to-GPU maps out."""

    algorithm: str = Field(
        DEFAULT_ALGORITHM,
        description=(
            "placement algorithm of periodic rebalances: stable (default; starts from the "
            "map in force and moves experts only where the predicted moe_lb gain pays for "
            "the transfer, never two replicas of one expert on one GPU) or reference (the "
            "published algorithm, which ignores the map in force)"
        ),
    )
    min_gain_per_gib: float = Field(
        0.0002,
        ge=0.0,
        le=1e6,
        description=(
            "stable: drop in overall moe_lb a rebalance must predict per GiB of expert "
            "weights it moves (0.0002 = 0.02 percentage points per GiB; 0 = any gain)"
        ),
    )
    max_bytes_per_rebalance: int = Field(
        0,
        ge=0,
        le=1 << 50,
        description="stable: cap on expert weights moved by one rebalance, bytes (0 = no cap)",
    )
    noise_z: float = Field(
        3.0,
        ge=0.0,
        le=100.0,
        description=(
            "stable: a rebalance is applied only where its predicted gain exceeds this many "
            "standard errors of the window's sampling noise, estimated from the spread of "
            "the window's buckets (0 = off); exported as fulcrum_eplb_noise_threshold"
        ),
    )
    restart_gap: float = Field(
        0.005,
        ge=0.0,
        le=1e6,
        description=(
            "stable: a layer whose map in force is worse than a fresh placement by more "
            "than this fraction of its mean GPU load takes the fresh placement (matched to "
            "the map in force slot by slot) whatever the bytes, except under drift, where "
            "a restart of a layer fitted to an earlier window must pay like any move"
        ),
    )
    max_report_steps: int = Field(
        1 << 32,
        ge=1,
        le=(1 << 63) - 1,
        description="largest step_end - step_begin of one ReportLoad (INVALID_ARGUMENT beyond)",
    )
    reply_cache_bytes: int = Field(
        256 << 20,
        ge=0,
        le=1 << 40,
        description=(
            "bytes of encoded map replies (GetMap, WatchMaps, Rebalance) kept for reuse, "
            "least recently used dropped first"
        ),
    )
    max_groups: int = Field(
        64, ge=1, le=4096, description="EP groups held at once; beyond it RESOURCE_EXHAUSTED"
    )
    retry_after_ms: int = Field(
        1000,
        ge=1,
        le=3_600_000,
        description=(
            "retry hint sent with RESOURCE_EXHAUSTED (max_groups, max_watchers_per_group), "
            "milliseconds (the retry-after-ms trailer)"
        ),
    )
    max_layers: int = Field(512, ge=1, le=4096, description="largest num_layers accepted")
    max_experts: int = Field(4096, ge=1, le=65_536, description="largest num_experts accepted")
    max_ep_size: int = Field(1024, ge=1, le=65_536, description="largest ep_size accepted")
    window_buckets: int = Field(
        16,
        json_schema_extra={"restart_only": True},
        ge=1,
        le=1024,
        description=(
            "the window of N steps is kept as this many buckets of N / buckets steps "
            "(memory per group = buckets x layers x experts x 8 bytes)"
        ),
    )
    history_versions: int = Field(
        8, ge=1, le=1024, description="map versions kept per group for GetMap by version"
    )
    max_watchers_per_group: int = Field(
        1024, ge=1, le=1 << 20, description="concurrent WatchMaps streams per group"
    )
    snapshot_path: str | None = Field(
        None,
        json_schema_extra={"restart_only": True},
        description=(
            "directory where each group's map in force (on every change, before it takes "
            "effect) and statistics window are written atomically, one file pair per "
            "group, and read at start, so a restarted daemon serves the same versions "
            "(null = none)"
        ),
    )

    window_snapshot_interval_s: float = Field(
        10.0,
        ge=0.0,
        le=3600.0,
        description=(
            "how often the statistics windows (and the rebalance period counters) are "
            "written to the snapshot directory when they changed, seconds; they are also "
            "written at drain, so a restarted daemon resumes the window and the period "
            "instead of counting from zero (0 = at drain only; needs snapshot_path)"
        ),
    )

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        if value not in REGISTRY:
            raise ValueError(f"unknown EPLB algorithm; known: {', '.join(sorted(REGISTRY))}")
        return value
