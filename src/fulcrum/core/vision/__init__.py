"""Vision-encoder (VE) balancer core: patches, fleet view, policies (pure)."""

from fulcrum.core.vision.base import VisionPolicy, place_many
from fulcrum.core.vision.fleet import (
    MachineSpec,
    NoCapacity,
    Placement,
    VisionFleet,
    VisionTopology,
    commit,
    imbalance,
    release,
)
from fulcrum.core.vision.patches import (
    DEFAULT_MAX_SIDE,
    DEFAULT_PATCH_SIZE,
    InvalidImageError,
    checked_patches,
    patches,
    validate_image,
)
from fulcrum.core.vision.registry import DEFAULT_POLICY, REGISTRY, make_policy, policy_names

__all__ = [
    "DEFAULT_MAX_SIDE",
    "DEFAULT_PATCH_SIZE",
    "DEFAULT_POLICY",
    "REGISTRY",
    "InvalidImageError",
    "MachineSpec",
    "NoCapacity",
    "Placement",
    "VisionFleet",
    "VisionPolicy",
    "VisionTopology",
    "checked_patches",
    "commit",
    "imbalance",
    "make_policy",
    "patches",
    "place_many",
    "policy_names",
    "release",
    "validate_image",
]
