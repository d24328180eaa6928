"""``round_robin`` (baseline): the next eligible GPU in index order from a cursor.

State: ``cursor`` (a GPU index) is passed in and the next cursor is returned in the
Decision (``chosen index + 1``, modulo the fleet size); select never mutates anything.
Starting at ``cursor % n_gpus``, the first GPU passing the capacity filter is chosen,
wrapping around once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from fulcrum.core.decode.filters import check_kv_tokens, eligible, no_capacity
from fulcrum.core.decode.policy import DecodeParams
from fulcrum.core.decode.view import Decision, FleetView, NoCapacity

NAME: Final = "round_robin"


@dataclass(frozen=True, slots=True)
class RoundRobin:
    """The ``round_robin`` policy (see module docstring)."""

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
        n = view.n_gpus
        if n == 0:
            return no_capacity(view, kv_tokens)
        start = cursor % n
        if view.headroom.item(start) >= kv_tokens:  # O(1) common case: the cursor's GPU fits
            return Decision(gpu=start, cursor=(start + 1) % n)
        mask = eligible(view, kv_tokens)
        gpu = -1
        tail = mask[start:]
        i = int(tail.argmax())
        if bool(tail[i]):
            gpu = start + i
        elif start > 0:
            head = mask[:start]
            j = int(head.argmax())
            if bool(head[j]):
                gpu = j
        if gpu < 0:
            return no_capacity(view, kv_tokens)
        return Decision(gpu=gpu, cursor=(gpu + 1) % n)


def from_params(params: DecodeParams) -> RoundRobin:
    """Factory for the registry."""
    return RoundRobin()
