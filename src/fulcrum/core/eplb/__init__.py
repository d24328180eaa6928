"""Expert-parallel load balancer (EPLB): expert-to-GPU placement, pure core.

Entry point: :func:`rebalance` (``stable`` by default, ``reference`` as the published
baseline). Shapes: loads (n_layers, n_logical) tokens; maps (n_layers, n_physical).
Every returned map passes :mod:`fulcrum.core.eplb.validate` (else ``InvalidMap``);
:mod:`fulcrum.core.eplb.window` estimates a window's sampling noise and the gain it
explains.
"""

from fulcrum.core.eplb.layout import (
    ROLE_DEFAULTS,
    GroupLayout,
    PlacementMap,
    Role,
    identity_map,
    make_layout,
)
from fulcrum.core.eplb.metrics import Balance, Migration, balance, gpu_loads, migration
from fulcrum.core.eplb.params import DEFAULT_PARAMS, GIB, RebalanceParams
from fulcrum.core.eplb.registry import (
    DEFAULT_ALGORITHM,
    REGISTRY,
    RebalanceResult,
    algorithm_names,
    make_placer,
    rebalance,
    validate_loads,
)

__all__ = [
    "DEFAULT_ALGORITHM",
    "DEFAULT_PARAMS",
    "GIB",
    "REGISTRY",
    "ROLE_DEFAULTS",
    "Balance",
    "GroupLayout",
    "Migration",
    "PlacementMap",
    "RebalanceParams",
    "RebalanceResult",
    "Role",
    "algorithm_names",
    "balance",
    "gpu_loads",
    "identity_map",
    "make_layout",
    "make_placer",
    "migration",
    "rebalance",
    "validate_loads",
]
