"""``least_kv`` (baseline): the eligible GPU with the smallest total KV (tokens).

Ties go to fewer requests, then the lowest index; otherwise concurrency is ignored except
by the capacity filter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from fulcrum.core.decode.filters import check_kv_tokens, no_capacity
from fulcrum.core.decode.policy import DecodeParams, pick_min
from fulcrum.core.decode.view import Decision, FleetView, NoCapacity

NAME: Final = "least_kv"


@dataclass(frozen=True, slots=True)
class LeastKv:
    """The ``least_kv`` policy (see module docstring)."""

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
        gpu = pick_min(view.order_kv, view, kv_tokens)
        if gpu < 0:
            return no_capacity(view, kv_tokens)
        return Decision(gpu=gpu, cursor=cursor)


def from_params(params: DecodeParams) -> LeastKv:
    """Factory for the registry."""
    return LeastKv()
