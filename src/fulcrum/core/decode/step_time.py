"""``step_time``: the GPU whose predicted decode step time after the placement is lowest.

``step_ns = d0_ns + d1_ns * concurrency + d2_ns * total_kv`` evaluated with the request
added (concurrency + 1 requests, total_kv + kv_tokens tokens); ``d0_ns`` in ns, ``d1_ns``
in ns per request, ``d2_ns`` in ns per KV token, all from configuration. Lowest predicted
step time among GPUs passing the capacity filter wins; ties go to the lowest index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from fulcrum.core.decode.filters import check_kv_tokens
from fulcrum.core.decode.policy import F64, decided, pick_min
from fulcrum.core.decode.view import I64, Decision, FleetView, NoCapacity
from fulcrum.core.registry import check_bounds, knob

NAME: Final = "step_time"


@dataclass(frozen=True, slots=True)
class StepTimeParams:
    """Coefficients of ``step_ns = d0_ns + d1_ns * concurrency + d2_ns * total_kv``
    (YAML ``decode.step_time.*``)."""

    d0_ns: float = knob(5_000_000.0, "fixed cost of a step, ns", ge=0.0, le=1e12)
    d1_ns: float = knob(20_000.0, "cost per request in the batch, ns per request", ge=0.0, le=1e12)
    d2_ns: float = knob(0.5, "attention cost, ns per KV token", ge=0.0, le=1e9)

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, slots=True)
class StepTime(StepTimeParams):
    """The ``step_time`` policy (see module docstring): its coefficients
    (:class:`StepTimeParams`, checked at construction) and its ``select``."""

    @property
    def name(self) -> str:
        return NAME

    def predict_ns(self, view: FleetView, kv_tokens: int) -> F64:
        """Predicted step time (ns) of every GPU after adding the request; shape (n_gpus,)."""
        return (
            self.d0_ns
            + self.d1_ns * (view.concurrency + 1).astype(np.float64)
            + self.d2_ns * (view.kv_tokens + kv_tokens).astype(np.float64)
        )

    def select(
        self,
        view: FleetView,
        kv_tokens: int,
        rng: np.random.Generator,
        cursor: int = 0,
    ) -> Decision | NoCapacity:
        check_kv_tokens(kv_tokens)
        # The constant terms (d0, d1, d2*kv_tokens) do not change the order; dividing by
        # d1 > 0 neither, and leaves one multiply-add.
        key: F64 | I64
        if self.d1_ns > 0.0:
            # The key is >= 0 (finite parameters >= 0), as pick_min requires.
            key = np.multiply(view.kv_tokens, self.d2_ns / self.d1_ns, dtype=np.float64)
            key += view.concurrency
        elif self.d2_ns > 0.0:
            key = view.kv_tokens
        else:
            key = np.zeros(view.n_gpus, dtype=np.int64)
        return decided(view, kv_tokens, pick_min(key, view, kv_tokens), cursor)


def from_params(params: StepTimeParams) -> StepTime:
    """Factory for the registry."""
    return StepTime(params.d0_ns, params.d1_ns, params.d2_ns)
