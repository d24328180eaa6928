"""Knobs of a rebalance (used by ``stable``; ``reference`` ignores them).

- ``min_gain_per_gib``: the drop in overall moe_lb (dimensionless, e.g. 0.0002 = 0.02
  percentage point) a rebalance must predict for every GiB (2**30 bytes) of expert weights
  it moves. 0 moves whenever the predicted moe_lb improves at all. The default 0.0002
  lets a 58-layer DeepSeek-V3-sized group (44 MiB experts) move about 1-5% of its slots
  under slow popularity drift and nothing when popularity is steady.
- ``max_bytes``: cap on bytes moved by one rebalance (``None`` = no cap). When the cap
  binds, the most valuable moves (predicted moe_lb gain per byte) are made first and the
  rest wait for the next rebalance.
- ``max_iterations``: bound on local-search iterations (each iteration makes at most one
  move per layer); a safety net, normally never reached.
- ``restart_gap``: a layer whose map in force is worse than a fresh placement (matched
  to it slot by slot) by more than this fraction of its mean GPU load takes the fresh
  placement whatever the bytes (the map in force is far from balanced: first placement,
  a shift of the hot experts); smaller differences must pay for their bytes. Under
  drift (``stable``'s rule 7) a layer fitted to an earlier window gets no such
  exemption: its restart must pay like any move.
- ``noise_z``: a rebalance is applied only where its predicted gain exceeds ``noise_z``
  standard errors of the window's sampling noise (``core.eplb.window``); 0 disables it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_PARAMS", "GIB", "RebalanceParams"]

GIB: Final = 1 << 30


@dataclass(frozen=True, slots=True)
class RebalanceParams:
    """See the module docstring for units."""

    min_gain_per_gib: float = 0.0002
    max_bytes: int | None = None
    max_iterations: int = 4096
    noise_z: float = 3.0
    restart_gap: float = 0.005

    def __post_init__(self) -> None:
        if not self.min_gain_per_gib >= 0.0:
            raise ValueError(f"min_gain_per_gib: must be >= 0, got {self.min_gain_per_gib}")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"max_bytes: must be >= 0 or None, got {self.max_bytes}")
        if not 0.0 <= self.noise_z < float("inf"):
            raise ValueError(f"noise_z: must be in [0, inf), got {self.noise_z}")
        if not self.restart_gap >= 0.0:
            raise ValueError(f"restart_gap: must be >= 0 (inf = never), got {self.restart_gap}")
        if self.max_iterations <= 0:
            raise ValueError(f"max_iterations: must be > 0, got {self.max_iterations}")


DEFAULT_PARAMS: Final = RebalanceParams()
