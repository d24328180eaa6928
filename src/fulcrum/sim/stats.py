"""Running statistics of a simulation: weighted time series and per-stage step totals."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Series:
    """A time series: ``t_ns[i]``, ``value[i]`` and a weight (e.g. the step's tokens)."""

    t_ns: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)

    def add(self, t: int, v: float, w: float = 1.0) -> None:
        """Append one point."""
        self.t_ns.append(t)
        self.value.append(v)
        self.weight.append(w)

    def mean(self) -> float | None:
        """Weighted mean of the values (None when empty or weightless)."""
        total = sum(self.weight)
        if not self.value or total <= 0:
            return None
        return sum(v * w for v, w in zip(self.value, self.weight, strict=True)) / total


@dataclass(slots=True)
class StageTotals:
    """Sums over the steps of one stage: GPU-weighted actual and ideal time (ns x GPUs)."""

    steps: int = 0
    actual_ns: float = 0.0
    ideal_ns: float = 0.0
    tokens: int = 0
    window_ideal_ns: float = 0.0
    #: Where ``actual_ns - ideal_ns`` goes (ns x GPUs), summed over steps: a GPU that
    #: waits for the slowest one of its group because it had no work at all in the step
    #: (``idle_ns``), because all its work ended before the step did (``drained_ns``),
    #: or although work was left for later steps -- chunk cap, budget rounding
    #: (``short_ns``); and the MoE stretch of the step (``moe_ns``, moe_lb > 1).
    #: Decode counts every GPU's shortfall as ``drained_ns``.
    idle_ns: float = 0.0
    drained_ns: float = 0.0
    short_ns: float = 0.0
    moe_ns: float = 0.0
    #: Useful compute (ns x GPUs): the work done, at the cost model WITHOUT the fixed
    #: per-step cost (prefill: the chunks' variable costs; decode: ``d1*conc + d2*kv``
    #: per GPU and step). It does not depend on how the work is split into steps.
    useful_ns: float = 0.0

    @property
    def fraction(self) -> float:
        """Ideal / actual time over the steps that ran (1.0 when none did): the per-step
        balance ratio, a diagnostic only (engines that never step are not counted)."""
        return self.ideal_ns / self.actual_ns if self.actual_ns > 0 else 1.0
