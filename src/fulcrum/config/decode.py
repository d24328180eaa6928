"""Settings of the decode balancer: policy, its parameters, leases and bounds.

Every key is reloadable: on SIGHUP the decode table's ``apply_settings`` applies all of
them to the next call (none is restart-only).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from fulcrum.config.policies import (
    PolicySection,
    gpu_series_field,
    lease_field,
    policy_fields,
    sweep_field,
)
from fulcrum.config.tenancy import band_reserve_field
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

    def params(self) -> Any:
        """The parameter dataclass of the policy in force (``NoParams`` when it has none)."""
        return self.policy_params()
