"""Decode balancer core (pure): per-GPU fleet view, capacity filter, placement policies.

See SPEC.md section 4: balance per-GPU concurrency AND per-GPU total KV length.
"""

from fulcrum.core.decode.dual import DualParams
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
from fulcrum.core.decode.view import (
    Decision,
    FleetView,
    GpuWriter,
    NoCapacity,
    close_range,
    commit,
    copy_view,
    grow,
    imbalance,
    observe,
    open_range,
    release,
    resized,
    set_live,
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
    "branches",
    "check_allowed",
    "close_range",
    "commit",
    "copy_view",
    "eligible",
    "grow",
    "imbalance",
    "make_policy",
    "no_capacity",
    "observe",
    "open_range",
    "params_for",
    "release",
    "resized",
    "restrict",
    "select_allowed",
    "set_live",
    "write_gpu",
    "write_range",
]
