"""Registry of EPLB placement algorithms and the one public entry point ``rebalance``.

``stable`` (migration-aware) is the default; ``reference`` re-implements the published
algorithm as the baseline. Unknown names raise ``ValueError``. The algorithms register in
the generic :class:`fulcrum.core.registry.Registry`; each entry carries its
:class:`Promise` as the ``promise`` attribute (checked before every commit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from fulcrum.core.eplb import reference, stable, window
from fulcrum.core.eplb.layout import GroupLayout, PlacementMap
from fulcrum.core.eplb.metrics import Balance, Migration, balance, gpu_loads, migration
from fulcrum.core.eplb.params import DEFAULT_PARAMS, RebalanceParams
from fulcrum.core.eplb.validate import InvalidMap, validate_map
from fulcrum.core.registry import Registry

__all__ = [
    "DEFAULT_ALGORITHM",
    "REGISTRY",
    "InvalidMap",
    "Placer",
    "Promise",
    "RebalanceResult",
    "algorithm_names",
    "check_map",
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
        load_var: npt.NDArray[np.float64] | None = None,
    ) -> PlacementMap: ...


@dataclass(frozen=True, slots=True)
class Promise:
    """What an algorithm guarantees beyond a valid map (checked before every commit)."""

    no_colocation: bool
    node_limited: bool


#: What an algorithm registered without a ``promise`` guarantees: a valid map only.
NO_PROMISE: Final = Promise(no_colocation=False, node_limited=False)

DEFAULT_ALGORITHM: Final = stable.NAME

REGISTRY: Final[Registry[Placer]] = Registry("eplb")
REGISTRY.register(
    stable.NAME, lambda _: stable.place, promise=Promise(no_colocation=True, node_limited=True)
)
# the published algorithm may put two replicas of a hot expert on one GPU
REGISTRY.register(
    reference.NAME,
    lambda _: reference.place,
    promise=Promise(no_colocation=False, node_limited=True),
)


def promise_of(name: str) -> Promise:
    """The promise of algorithm ``name`` (:data:`NO_PROMISE` when unknown)."""
    if name not in REGISTRY:
        return NO_PROMISE
    promise: Promise = REGISTRY.entry(name).attrs.get("promise", NO_PROMISE)
    return promise


def check_map(name: str, layout: GroupLayout, placement: PlacementMap) -> None:
    """Raise :class:`InvalidMap` if ``placement`` breaks a rule or ``name``'s promise."""
    promise = promise_of(name)
    validate_map(
        layout,
        placement,
        no_colocation=promise.no_colocation,
        node_limited=promise.node_limited,
    )


def algorithm_names() -> tuple[str, ...]:
    """Registered algorithm names, sorted."""
    return tuple(sorted(REGISTRY))


def make_placer(name: str) -> Placer:
    """The placement function registered under ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the known names).
    """
    if name not in REGISTRY:
        raise ValueError(
            f"algorithm: unknown EPLB algorithm {name!r}; known: {', '.join(algorithm_names())}"
        )
    return REGISTRY.make(name)


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
        noise_threshold: overall moe_lb gain the window's sampling noise can explain
            (``core.eplb.window``; 0.0 without a noise estimate).
    """

    algorithm: str
    placement: PlacementMap
    before: Balance | None
    after: Balance
    migration: Migration
    noise_threshold: float = 0.0

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
    load_var: npt.ArrayLike | None = None,
) -> RebalanceResult:
    """Compute a new expert-to-GPU map for one EP group.

    Args:
        name: algorithm (``stable`` or ``reference``).
        layout: the group's shape.
        loads: shape (n_layers, n_logical), tokens routed to each logical expert over the
            statistics window.
        previous_map: the map in force (shape (n_layers, n_physical)), or None.
        params: migration weight / cap / noise z (``stable`` only).
        load_var: shape (n_layers, n_logical), variance of ``loads`` from the window's
            buckets (``window.window_variance``), or None.

    Raises:
        InvalidMap: the algorithm returned a map that breaks a rule or its promise.
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
    var = None if load_var is None else validate_loads(layout, load_var)
    new = placer(layout, w, previous_map, params, var)
    check_map(name, layout, new)
    before = balance(w, previous_map) if previous_map is not None else None
    return RebalanceResult(
        algorithm=name,
        placement=new,
        before=before,
        after=balance(w, new),
        migration=migration(previous_map, new, layout.expert_bytes),
        noise_threshold=_threshold(layout, w, var, previous_map, new, params.noise_z),
    )


def _threshold(
    layout: GroupLayout,
    w: npt.NDArray[np.float64],
    var: npt.NDArray[np.float64] | None,
    old: PlacementMap | None,
    new: PlacementMap,
    z: float,
) -> float:
    """Overall moe_lb gain the window's noise explains for going from ``old`` to ``new``."""
    if var is None or old is None:
        return 0.0
    top = float(w.max()) if w.size else 0.0
    if not top > 0.0:
        return 0.0
    ws = w / top
    sd = np.sqrt(var) / top
    vs = np.where(np.isfinite(sd), sd * sd, np.finfo(np.float64).max)
    gl_old = gpu_loads(ws, old.phy2log, layout.ep_size)
    gl_new = gpu_loads(ws, new.phy2log, layout.ep_size)
    noise = window.layer_noise(vs, old.phy2log, new.phy2log, gl_old, gl_new, layout.ep_size)
    changed = (old.phy2log != new.phy2log).any(axis=1)
    if not changed.any():
        changed = np.ones_like(changed)  # unchanged map: the threshold it had to beat
    return window.noise_threshold(noise, changed, float(ws.sum()) / layout.ep_size, z)
