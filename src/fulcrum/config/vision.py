"""Settings of the vision-encoder (VE) balancer.

Every key is reloadable: on SIGHUP the vision table's ``apply_settings`` applies all of
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
from fulcrum.core.vision.registry import DEFAULT_POLICY, REGISTRY


class VisionSettings(PolicySection):
    """The vision balancer: image patches in flight on VE GPUs.

    ``vision.policy`` is a name of :data:`fulcrum.core.vision.registry.REGISTRY`; a
    policy with parameters would have its section ``vision.<policy>.*`` (the shipped ones
    take none).
    """

    REGISTRY: ClassVar = REGISTRY
    NOUN: ClassVar[str] = "VE policy"

    policy: str = Field(
        DEFAULT_POLICY,
        description=(
            "placement policy: random_machine (published rule: uniformly random VE machine, "
            "then its GPU with the fewest patches in flight), power_of_two (less loaded of "
            "two random machines) or least_patches (globally least-loaded GPU)"
        ),
    )
    for _name, (_section, _field) in policy_fields(REGISTRY).items():
        __annotations__[_name] = _section
        vars()[_name] = _field
    patch_size: int = Field(
        16, ge=1, le=4096, description="patch side used when an image gives none, pixels"
    )
    max_side: int = Field(
        16_384,
        ge=1,
        le=1 << 20,
        description="largest accepted image side (and patch size), pixels; bigger is refused",
    )
    max_images_per_request: int = Field(
        64, ge=1, le=4096, description="images in one PlaceImages request"
    )
    lease_ms: int = lease_field(120_000)
    sweep_interval_ms: int = sweep_field()
    band_reserve: float = band_reserve_field()
    max_placements: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="placed requests held at once; beyond it PlaceImages is RESOURCE_EXHAUSTED",
    )

    metrics_gpu_series: int = gpu_series_field("VE")

    def params(self) -> Any:
        """The parameter dataclass of the policy in force (``NoParams`` when it has none)."""
        return self.policy_params()
