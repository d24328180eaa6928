"""Settings of the decode balancer: policy, its parameters, leases and bounds; all
reloadable (:mod:`fulcrum.config.placement`)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from fulcrum.config.placement import TableSection, add_policy_sections
from fulcrum.config.policies import (
    gpu_series_field,
    lease_field,
    sweep_field,
)
from fulcrum.config.tenancy import band_reserve_field
from fulcrum.core.decode.registry import DEFAULT_POLICY, REGISTRY
from fulcrum.core.decode.view import MAX_KV_LIMIT


class DecodeSettings(TableSection):
    """The decode balancer: per-GPU concurrency AND per-GPU total KV.

    ``decode.policy`` is a name of :data:`fulcrum.core.decode.registry.REGISTRY`; each
    policy with parameters has its section ``decode.<policy>.*`` (e.g. ``decode.dual``),
    derived from the policy's own parameter dataclass.
    """

    REGISTRY: ClassVar = REGISTRY
    NOUN: ClassVar[str] = "decode policy"

    policy: str = Field(
        DEFAULT_POLICY,
        description=(
            "placement policy: dual (published rule: short request -> low concurrency but "
            "large total KV, long request -> smallest total KV), step_time (lowest predicted "
            "step time), or the baselines least_requests, least_kv, round_robin, power_of_two"
        ),
    )
    # One section per registered policy with parameters, right after ``policy``.
    add_policy_sections(vars(), REGISTRY)
    lease_ms: int = lease_field(600_000)
    sweep_interval_ms: int = sweep_field()
    band_reserve: float = band_reserve_field()
    max_placements: int = Field(
        1_000_000,
        ge=1,
        le=50_000_000,
        description="placements held at once; beyond it PlaceDecode is RESOURCE_EXHAUSTED",
    )
    max_request_kv_tokens: int = Field(
        1 << 32,
        ge=1,
        le=MAX_KV_LIMIT - 1,
        description="largest KV length one request may ask for; bigger is refused, tokens",
    )

    metrics_gpu_series: int = gpu_series_field("decode")
