"""Decode balancer core (pure): per-GPU fleet view, capacity filter, placement policies.

See SPEC.md section 4: balance per-GPU concurrency AND per-GPU total KV length.
"""

from fulcrum.core.decode.dual import DualParams
from fulcrum.core.decode.fallbacks import best_slots
from fulcrum.core.decode.filters import (
    Allowed,
    check_allowed,
    eligible,
    no_capacity,
    restrict,
    select_allowed,
)
from fulcrum.core.decode.policy import DecodePolicy
from fulcrum.core.decode.registry import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    REGISTRY,
    branches,
    make_policy,
    params_for,
)
from fulcrum.core.decode.step_time import StepTimeParams
from fulcrum.core.decode.view import Decision, FleetView, NoCapacity, imbalance
from fulcrum.core.decode.writers import (
    GpuWriter,
    close_range,
    open_range,
    resized,
    write_gpu,
    write_range,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "REGISTRY",
    "Allowed",
    "Decision",
    "DecodePolicy",
    "DualParams",
    "FleetView",
    "GpuWriter",
    "NoCapacity",
    "StepTimeParams",
    "best_slots",
    "branches",
    "check_allowed",
    "close_range",
    "eligible",
    "imbalance",
    "make_policy",
    "no_capacity",
    "open_range",
    "params_for",
    "resized",
    "restrict",
    "select_allowed",
    "write_gpu",
    "write_range",
]
