"""Load-blind and count-based baselines, for decisions where the core has no such policy.

The simulator prefers the core's own modules: decode ``round_robin``, ``least_requests``
and ``power_of_two`` and VE ``power_of_two`` come from ``fulcrum.core``. This module only
covers what the core does not register -- the prefill rank choice of a conventional
push router (no tiers, no pull), decode ``random``, and VE ``round_robin``, ``random``
and ``least_requests`` -- with the textbook rules over a per-target count array
``counts`` (shape (n,), int64: requests or images in flight):

* ``round_robin``: target ``cursor % n``; the cursor advances by one.
* ``random``: uniform target (one ``rng.integers(n)`` draw).
* ``least_requests``: smallest count; ties to the lowest index.
* ``power_of_two``: two distinct uniform targets, the smaller count wins (ties: first).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

ROUND_ROBIN: Final = "round_robin"
RANDOM: Final = "random"
LEAST_REQUESTS: Final = "least_requests"
POWER_OF_TWO: Final = "power_of_two"
NAMES: Final = (ROUND_ROBIN, RANDOM, LEAST_REQUESTS, POWER_OF_TWO)


def choose(
    name: str, counts: npt.NDArray[np.int64], rng: np.random.Generator, cursor: int
) -> tuple[int, int]:
    """Target index and next cursor under baseline ``name`` (see module docstring)."""
    n = int(counts.shape[0])
    if n == 0:
        raise ValueError("counts: need at least one target")
    if name == ROUND_ROBIN:
        i = cursor % n
        return i, (i + 1) % n
    if name == RANDOM:
        return int(rng.integers(n)), cursor
    if name == LEAST_REQUESTS:
        return int(counts.argmin()), cursor
    if name == POWER_OF_TWO:
        if n == 1:
            return 0, cursor
        a = int(rng.integers(n))
        b = int(rng.integers(n - 1))
        if b >= a:
            b += 1
        return (b if counts[b] < counts[a] else a), cursor
    raise ValueError(f"baseline: unknown name {name!r} (known: {', '.join(NAMES)})")
