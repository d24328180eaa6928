"""``power_of_two`` (baseline): two random eligible GPUs, the one with fewer requests.

Two distinct GPUs are drawn uniformly from those passing the capacity filter with the
injected ``numpy.random.Generator``; the one with fewer requests wins, then the one with
less total KV (tokens), then the first drawn. With one eligible GPU it is chosen without
drawing. Same generator state -> same decision.

Drawing: up to ``REJECTION_TRIES`` uniform draws over all GPUs, keeping the first two
distinct eligible ones (exactly uniform over ordered pairs of eligible GPUs, and O(1) when
most GPUs are eligible); if that does not find two, a fresh uniform pair is drawn from
the explicit list of eligible GPUs (one vectorised pass).
"""

from __future__ import annotations

from typing import ClassVar, Final

import numpy as np

from fulcrum.core.decode.policy import Checked, decided
from fulcrum.core.decode.view import Decision, FleetView, NoCapacity

NAME: Final = "power_of_two"
REJECTION_TRIES: Final = 8


class PowerOfTwo(Checked):
    """The ``power_of_two`` policy (see module docstring)."""

    __slots__ = ()
    name: ClassVar[str] = NAME

    def choose(
        self, view: FleetView, kv_tokens: int, rng: np.random.Generator, cursor: int
    ) -> Decision | NoCapacity:
        n = view.n_gpus
        headroom = view.headroom
        first = -1
        for _ in range(REJECTION_TRIES if n > 1 else 0):
            g = int(rng.integers(n))
            if g != first and int(headroom[g]) >= kv_tokens:
                if first < 0:
                    first = g
                else:
                    return Decision(gpu=self._better(view, first, g), cursor=cursor)
        return decided(view, kv_tokens, self._from_list(view, kv_tokens, rng), cursor)

    def _from_list(self, view: FleetView, kv_tokens: int, rng: np.random.Generator) -> int:
        """A fresh uniform pair from the explicit list of eligible GPUs; -1 when none."""
        idx = np.flatnonzero(view.headroom >= kv_tokens)
        k = int(idx.shape[0])
        if k <= 1:
            return int(idx[0]) if k else -1
        i = int(rng.integers(k))
        j = int(rng.integers(k - 1))
        if j >= i:
            j += 1
        return self._better(view, int(idx[i]), int(idx[j]))

    @staticmethod
    def _better(view: FleetView, a: int, b: int) -> int:
        """The GPU with fewer requests, then less KV; ``a`` on a tie."""
        key_a = (int(view.concurrency[a]), int(view.kv_tokens[a]))
        key_b = (int(view.concurrency[b]), int(view.kv_tokens[b]))
        return b if key_b < key_a else a


def from_params(params: object) -> PowerOfTwo:
    """Factory for the registry (no parameters)."""
    return PowerOfTwo()
