"""Registry of EPLB placement algorithms and the one public entry point ``rebalance``.

``stable`` (migration-aware) is the default; ``reference`` re-implements the published
algorithm as the baseline. Unknown names raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from fulcrum.core.eplb import reference, stable
from fulcrum.core.eplb.layout import GroupLayout, PlacementMap
from fulcrum.core.eplb.metrics import Balance, Migration, balance, migration
from fulcrum.core.eplb.params import DEFAULT_PARAMS, RebalanceParams

__all__ = [
    "DEFAULT_ALGORITHM",
    "REGISTRY",
    "Placer",
    "RebalanceResult",
    "algorithm_names",
    "make_placer",
    "rebalance",
    "validate_loads",
]


class Placer(Protocol):
    """A placement algorithm: loads (n_layers, n_logical) tokens -> a new map."""

    def __call__(
        self,
        layout: GroupLayout,
        loads: npt.NDArray[np.float64],
        previous: PlacementMap | None,
        params: RebalanceParams,
    ) -> PlacementMap: ...


DEFAULT_ALGORITHM: Final = stable.NAME

REGISTRY: Final[Mapping[str, Placer]] = MappingProxyType(
    {
        stable.NAME: stable.place,
        reference.NAME: reference.place,
    }
)


def algorithm_names() -> tuple[str, ...]:
    """Registered algorithm names, sorted."""
    return tuple(sorted(REGISTRY))


def make_placer(name: str) -> Placer:
    """The placement function registered under ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the known names).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"algorithm: unknown EPLB algorithm {name!r}; known: {', '.join(algorithm_names())}"
        ) from None


@dataclass(frozen=True, slots=True)
class RebalanceResult:
    """Outcome of one rebalance.

    Attributes:
        algorithm: registry name used.
        placement: the new map.
        before: predicted moe_lb of the previous map under the window's loads (None when
            there was no previous map).
        after: predicted moe_lb of the new map under the same loads.
        migration: slots changed, copies received, bytes moved (zero without a previous map).
    """

    algorithm: str
    placement: PlacementMap
    before: Balance | None
    after: Balance
    migration: Migration

    @property
    def changed(self) -> bool:
        """Whether the new map differs from the previous one (always True for a first map)."""
        return self.before is None or self.migration.slots_changed > 0


def validate_loads(layout: GroupLayout, loads: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Loads as float64 of shape (n_layers, n_logical), finite and >= 0.

    Raises:
        ValueError: wrong shape, negative or non-finite values (the message names the rule).
    """
    w = np.asarray(loads, dtype=np.float64)
    want = (layout.n_layers, layout.n_logical)
    if w.shape != want:
        raise ValueError(f"loads: shape must be {want}, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("loads: values must be finite")
    if (w < 0).any():
        raise ValueError("loads: values must be >= 0")
    return w


def rebalance(
    name: str,
    layout: GroupLayout,
    loads: npt.ArrayLike,
    previous_map: PlacementMap | None,
    params: RebalanceParams = DEFAULT_PARAMS,
) -> RebalanceResult:
    """Compute a new expert-to-GPU map for one EP group.

    Args:
        name: algorithm (``stable`` or ``reference``).
        layout: the group's shape.
        loads: shape (n_layers, n_logical), tokens routed to each logical expert over the
            statistics window.
        previous_map: the map in force (shape (n_layers, n_physical)), or None.
        params: migration weight / cap (``stable`` only).

    Raises:
        ValueError: unknown algorithm, bad loads, or a previous map of another shape.
    """
    placer = make_placer(name)
    w = validate_loads(layout, loads)
    if previous_map is not None and (
        previous_map.phy2log.shape != (layout.n_layers, layout.n_physical)
        or previous_map.ep_size != layout.ep_size
        or previous_map.n_logical != layout.n_logical
    ):
        raise ValueError(
            f"previous_map: shape {previous_map.phy2log.shape} does not match the layout "
            f"({layout.n_layers}, {layout.n_physical})"
        )
    new = placer(layout, w, previous_map, params)
    before = balance(w, previous_map) if previous_map is not None else None
    return RebalanceResult(
        algorithm=name,
        placement=new,
        before=before,
        after=balance(w, new),
        migration=migration(previous_map, new, layout.expert_bytes),
    )
