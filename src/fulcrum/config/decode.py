"""Settings of the decode balancer: policy, its parameters, leases and bounds.

Every key is reloadable: on SIGHUP the decode table's ``apply_settings`` applies all of
them to the next call (none is restart-only).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from fulcrum.config.policies import PolicySection, policy_fields
from fulcrum.core.decode.registry import DEFAULT_POLICY, REGISTRY
from fulcrum.core.decode.view import MAX_KV_LIMIT


class DecodeSettings(PolicySection):
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
    for _name, (_section, _field) in policy_fields(REGISTRY).items():
        __annotations__[_name] = _section
        vars()[_name] = _field
    del _name, _section, _field
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

    def params(self) -> Any:
        """The parameter dataclass of the policy in force (``NoParams`` when it has none)."""
        return self.policy_params()
