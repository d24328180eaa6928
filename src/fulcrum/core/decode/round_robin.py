"""``round_robin`` (baseline): the next eligible GPU in index order from a cursor.

State: ``cursor`` (a GPU index) is passed in and the next cursor is returned in the
Decision (``chosen index + 1``, modulo the fleet size); select never mutates anything.
Starting at ``cursor % n_gpus``, the first GPU passing the capacity filter is chosen,
wrapping around once.
"""

from __future__ import annotations

from typing import ClassVar, Final

import numpy as np

from fulcrum.core.decode.filters import eligible, no_capacity
from fulcrum.core.decode.policy import Checked, decided
from fulcrum.core.decode.view import Decision, FleetView, Mask, NoCapacity

NAME: Final = "round_robin"


class RoundRobin(Checked):
    """The ``round_robin`` policy (see module docstring)."""

    __slots__ = ()
    name: ClassVar[str] = NAME

    def choose(
        self, view: FleetView, kv_tokens: int, rng: np.random.Generator, cursor: int
    ) -> Decision | NoCapacity:
        n = view.n_gpus
        if n == 0:
            return no_capacity(view, kv_tokens)
        start = cursor % n
        if view.headroom.item(start) >= kv_tokens:  # O(1) common case: the cursor's GPU fits
            return Decision(gpu=start, cursor=(start + 1) % n)
        gpu = _first_from(eligible(view, kv_tokens), start)
        return decided(view, kv_tokens, gpu, (gpu + 1) % n)


def _first_from(mask: Mask, start: int) -> int:
    """The first set index of ``mask`` at or after ``start``, wrapping once; -1 if none."""
    tail = mask[start:]
    i = int(tail.argmax())
    if bool(tail[i]):
        return start + i
    if start > 0:
        head = mask[:start]
        j = int(head.argmax())
        if bool(head[j]):
            return j
    return -1


def from_params(params: object) -> RoundRobin:
    """Factory for the registry (no parameters)."""
    return RoundRobin()
