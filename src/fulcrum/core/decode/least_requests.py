"""``least_requests`` (baseline): the eligible GPU with the fewest requests.

Ties go to the lowest index; KV length is ignored except by the capacity filter. This is
what today's request-count routers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from fulcrum.core.decode.filters import check_kv_tokens, no_capacity
from fulcrum.core.decode.policy import DecodeParams, pick_min
from fulcrum.core.decode.view import KV_BITS, Decision, FleetView, NoCapacity

NAME: Final = "least_requests"


@dataclass(frozen=True, slots=True)
class LeastRequests:
    """The ``least_requests`` policy (see module docstring)."""

    @property
    def name(self) -> str:
        return NAME

    def select(
        self,
        view: FleetView,
        kv_tokens: int,
        rng: np.random.Generator,
        cursor: int = 0,
    ) -> Decision | NoCapacity:
        check_kv_tokens(kv_tokens)
        # order_conc >> 40 is the concurrency of open GPUs and 2**23 - 1 for closed ones.
        gpu = pick_min(view.order_conc >> KV_BITS, view, kv_tokens)
        if gpu < 0:
            return no_capacity(view, kv_tokens)
        return Decision(gpu=gpu, cursor=cursor)


def from_params(params: DecodeParams) -> LeastRequests:
    """Factory for the registry."""
    return LeastRequests()
