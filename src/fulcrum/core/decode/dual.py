"""``dual`` (default): the published two-dimensional rule, concurrency AND total KV.

Definitions (tokens; requests):

- ``mean`` = total KV tokens / total requests over live GPUs (the fleet's current mean
  KV per request); undefined when the fleet holds no request.
- ``threshold`` = ``min(long_tokens, long_factor * mean)``, or ``long_tokens`` when
  ``mean`` is undefined. Defaults: ``long_factor = 2.0``, ``long_tokens = 65,536``.
- a request of ``kv_tokens`` is **long** iff ``kv_tokens >= threshold``, else **short**.

Among GPUs that pass the capacity filter:

- **long** -> the GPU with the smallest total KV (attention time dominates, so it goes
  where attention is lightest); ties: fewer requests, then the lowest index. Its
  concurrency need not be the lowest.
- **short** -> a GPU with low concurrency but large total KV: candidates are GPUs whose
  concurrency is at most ``min_concurrency + short_slack`` (``short_slack`` defaults to
  0); among them the one with the largest total KV; ties: fewer requests, then the
  lowest index. A short request adds batch size (MoE/linear time) but little attention,
  so it fills the concurrency gap of GPUs busy with a few long requests and leaves
  small-KV GPUs free for the next long request.

The worked example's 100K-token decode is long whenever the fleet's mean is below 50K
tokens, or in any case since 100K >= 65,536: it goes to the smallest total KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from fulcrum.core.decode.filters import check_kv_tokens, eligible
from fulcrum.core.decode.policy import argmin_where, decided, pick_min
from fulcrum.core.decode.view import (
    INT64_MAX,
    MAX_CONCURRENCY_LIMIT,
    MAX_KV_LIMIT,
    Decision,
    FleetView,
    NoCapacity,
)
from fulcrum.core.registry import check_bounds, knob

NAME: Final = "dual"
SHORT: Final = "short"
LONG: Final = "long"
#: The branch labels of its decisions (``Decision.kind``; also a metric label).
BRANCHES: Final = (SHORT, LONG)


@dataclass(frozen=True, slots=True)
class DualParams:
    """Parameters of ``dual`` (YAML ``decode.dual.*``)."""

    long_factor: float = knob(
        2.0,
        "a request is long when its KV length is at least this many times the fleet's "
        "current mean KV per request (or at least long_tokens), dimensionless",
        gt=0.0,
        le=1000.0,
    )
    long_tokens: int = knob(
        65_536,
        "a request of at least this KV length is always long, tokens",
        ge=1,
        le=MAX_KV_LIMIT - 1,
    )
    short_slack: int = knob(
        0,
        "a short request may go to a GPU with up to this many more requests than the "
        "least-loaded one when that GPU holds more KV, requests",
        ge=0,
        le=1_000_000,
    )

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, slots=True)
class Dual(DualParams):
    """The ``dual`` policy (see module docstring): its parameters (:class:`DualParams`,
    checked at construction) and its ``select``."""

    @property
    def name(self) -> str:
        return NAME

    def threshold(self, view: FleetView) -> float:
        """KV length (tokens) at and above which a request counts as long."""
        totals: list[int] = view.totals.tolist()  # == mean_kv_per_request(), one numpy call
        reqs = totals[0]
        if reqs <= 0:
            return float(self.long_tokens)
        return min(float(self.long_tokens), self.long_factor * (totals[1] / reqs))

    def is_long(self, view: FleetView, kv_tokens: int) -> bool:
        """Whether a request of ``kv_tokens`` tokens takes the long branch on ``view``."""
        return kv_tokens >= self.threshold(view)

    def select(
        self,
        view: FleetView,
        kv_tokens: int,
        rng: np.random.Generator,
        cursor: int = 0,
    ) -> Decision | NoCapacity:
        check_kv_tokens(kv_tokens)
        if kv_tokens >= self.threshold(view):  # == self.is_long(view, kv_tokens)
            # order_kv: less KV first, then fewer requests (closed GPUs last).
            gpu = pick_min(view.order_kv, view, kv_tokens)
            kind = LONG
        elif self.short_slack == 0:
            # order_conc: fewer requests first, then more KV (closed GPUs last).
            gpu = pick_min(view.order_conc, view, kv_tokens)
            kind = SHORT
        else:
            gpu = self._short_with_slack(view, kv_tokens)
            kind = SHORT
        return decided(view, kv_tokens, gpu, cursor, kind)

    def _short_with_slack(self, view: FleetView, kv_tokens: int) -> int:
        """Short branch with ``short_slack > 0``: most KV among near-least-loaded GPUs."""
        mask = eligible(view, kv_tokens)
        conc = np.where(mask, view.concurrency, INT64_MAX)
        if conc.shape[0] == 0:
            return -1
        cmin = int(conc.min())
        if cmin == INT64_MAX:
            return -1
        cand = conc <= cmin + self.short_slack
        # more KV first, then fewer requests
        key = (MAX_KV_LIMIT - 1 - view.kv_tokens) * MAX_CONCURRENCY_LIMIT + view.concurrency
        return argmin_where(key, cand)


def from_params(params: DualParams) -> Dual:
    """Factory for the registry."""
    return Dual(params.long_factor, params.long_tokens, params.short_slack)
