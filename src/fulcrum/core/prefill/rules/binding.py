"""Binding rules: when an engine has room, and how far one pull may load its DP ranks.

* ``early_binding`` (published): an idle engine has room; a pull is bounded by the
  engine's remaining quota and the tier cap only.
* ``late_binding`` (default, ``horizon_steps`` = 0.1): a pull takes the FIFO head only
  while the engine's least-loaded DP rank holds less than ``horizon_steps`` step budgets
  of outstanding work (``horizon_steps x step_quota_ns``, ns), so work waits in the shared
  tier queue until a rank is about to need it instead of being committed early to one
  engine's queue. Under prefix affinity a request the engine holds a prefix of is exempt
  (binding it early saves recomputing the prefix).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fulcrum.core.prefill.rules.base import RULES, BindingRule, RankFill
from fulcrum.core.registry import NoParams


class _NeverFull:
    """Early binding: no horizon, a pull is bounded by quota only."""

    def full(self) -> bool:
        return False

    def place(self, cost_ns: int) -> None:
        return None


class _Horizon:
    """Late binding over a heap of rank loads (ns): each request goes to the least-loaded
    rank (as core ``assign_ranks`` will place it)."""

    def __init__(self, loads_ns: Sequence[int], horizon_ns: int) -> None:
        self._heap = [(int(x), r) for r, x in enumerate(loads_ns)]
        heapq.heapify(self._heap)
        self._horizon = horizon_ns

    def full(self) -> bool:
        return (self._heap[0][0] if self._heap else 0) >= self._horizon

    def place(self, cost_ns: int) -> None:
        load, r = self._heap[0]
        heapq.heapreplace(self._heap, (load + int(cost_ns), r))


@dataclass(frozen=True, slots=True)
class EarlyBinding(BindingRule):
    """An idle engine has room; no rank horizon."""

    name: ClassVar[str] = "early_binding"

    def horizon_ns(self, step_quota_ns: int) -> int | None:
        return None

    def has_room(self, loads_ns: Sequence[int], step_quota_ns: int) -> bool:
        return not any(loads_ns)

    def fill(self, loads_ns: Sequence[int], step_quota_ns: int) -> RankFill:
        return _NeverFull()

    def full(self, loads_ns: Sequence[int], step_quota_ns: int) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class LateBindingParams:
    """``horizon_steps``: a rank takes work while it holds less than this many step
    budgets of outstanding work (> 0, finite)."""

    horizon_steps: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.horizon_steps, bool) or not isinstance(self.horizon_steps,
                                                                   int | float):
            raise ValueError("horizon_steps: must be a number")
        if not (math.isfinite(self.horizon_steps) and self.horizon_steps > 0):
            raise ValueError("horizon_steps: must be > 0 and finite")


@dataclass(frozen=True, slots=True)
class LateBinding(BindingRule):
    """A rank takes work only while below ``horizon_steps`` step budgets."""

    name: ClassVar[str] = "late_binding"
    horizon_steps: float = 0.1

    def horizon_ns(self, step_quota_ns: int) -> int | None:
        return int(self.horizon_steps * step_quota_ns)

    def has_room(self, loads_ns: Sequence[int], step_quota_ns: int) -> bool:
        return min(loads_ns, default=0) < int(self.horizon_steps * step_quota_ns)

    def fill(self, loads_ns: Sequence[int], step_quota_ns: int) -> RankFill:
        return _Horizon(loads_ns, int(self.horizon_steps * step_quota_ns))

    def full(self, loads_ns: Sequence[int], step_quota_ns: int) -> bool:
        return min(loads_ns, default=0) >= int(self.horizon_steps * step_quota_ns)


RULES.register(EarlyBinding.name, lambda p: EarlyBinding(), NoParams, kind=EarlyBinding.kind)
RULES.register(LateBinding.name, lambda p: LateBinding(float(p.horizon_steps)),
               LateBindingParams, kind=LateBinding.kind)
