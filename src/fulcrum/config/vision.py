"""Settings of the vision-encoder (VE) balancer: policy, patch defaults, image bounds,
leases; every key takes effect on reload (see :mod:`fulcrum.config.placement`)."""

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
from fulcrum.core.vision.registry import DEFAULT_POLICY, REGISTRY


class VisionSettings(TableSection):
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
    # One section per registered policy with parameters, right after ``policy``.
    add_policy_sections(vars(), REGISTRY)
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
