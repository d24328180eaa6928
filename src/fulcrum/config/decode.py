"""Settings of the decode balancer: policy, its parameters, leases and bounds.

Every key is reloadable: on SIGHUP the decode table's ``apply_settings`` applies all of
them to the next call (none is restart-only).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from fulcrum.config.base import Section
from fulcrum.core.decode.policy import DecodeParams
from fulcrum.core.decode.registry import DEFAULT_POLICY, REGISTRY
from fulcrum.core.decode.view import MAX_KV_LIMIT


class DualSettings(Section):
    """Parameters of the ``dual`` policy (short vs. long request)."""

    long_factor: float = Field(
        2.0,
        gt=0.0,
        le=1000.0,
        description=(
            "a request is long when its KV length is at least this many times the fleet's "
            "current mean KV per request (or at least long_tokens), dimensionless"
        ),
    )
    long_tokens: int = Field(
        65_536,
        ge=1,
        le=MAX_KV_LIMIT - 1,
        description="a request of at least this KV length is always long, tokens",
    )
    short_slack: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "a short request may go to a GPU with up to this many more requests than the "
            "least-loaded one when that GPU holds more KV, requests"
        ),
    )


class StepTimeSettings(Section):
    """Coefficients of ``step_ns = d0_ns + d1_ns * concurrency + d2_ns * total_kv``."""

    d0_ns: float = Field(5_000_000.0, ge=0.0, le=1e12, description="fixed cost of a step, ns")
    d1_ns: float = Field(
        20_000.0, ge=0.0, le=1e12, description="cost per request in the batch, ns per request"
    )
    d2_ns: float = Field(0.5, ge=0.0, le=1e9, description="attention cost, ns per KV token")


class DecodeSettings(Section):
    """The decode balancer: per-GPU concurrency AND per-GPU total KV."""

    policy: str = Field(
        DEFAULT_POLICY,
        description=(
            "placement policy: dual (published rule: short request -> low concurrency but "
            "large total KV, long request -> smallest total KV), step_time (lowest predicted "
            "step time), or the baselines least_requests, least_kv, round_robin, power_of_two"
        ),
    )
    dual: DualSettings = Field(default_factory=DualSettings)
    step_time: StepTimeSettings = Field(default_factory=StepTimeSettings)
    lease_ms: int = Field(
        600_000,
        ge=10,
        le=86_400_000,
        description="placements not released within this time expire (and are counted), ms",
    )
    sweep_interval_ms: int = Field(
        500, ge=5, le=60_000, description="period of the lease-expiry sweep, ms"
    )
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

    metrics_gpu_series: int = Field(
        256,
        ge=0,
        le=1_000_000,
        description=(
            "per-GPU gauges are exported for every decode GPU while there are at most "
            "this many, else for this many most loaded GPUs (per-member sums and summaries "
            "are always exported); bounds the /metrics size at full scale, GPUs"
        ),
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in REGISTRY:
            known = ", ".join(sorted(REGISTRY))
            raise ValueError(f"unknown decode policy {value!r}; known: {known}")
        return value

    def params(self) -> DecodeParams:
        """The core's parameter object."""
        return DecodeParams(
            long_factor=self.dual.long_factor,
            long_tokens=self.dual.long_tokens,
            short_slack=self.dual.short_slack,
            d0_ns=self.step_time.d0_ns,
            d1_ns=self.step_time.d1_ns,
            d2_ns=self.step_time.d2_ns,
        )
