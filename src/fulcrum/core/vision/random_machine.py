"""``random_machine``: the published VE rule (SPEC.md section 5), the default.

Rule: pick a VE machine uniformly at random, with the injected
``numpy.random.Generator``, among the machines that have at least one eligible GPU
(live, and with room for the image's patches when a per-GPU capacity is set); on that
machine the image goes to the eligible GPU with the fewest patches in flight, ties to the
lowest GPU index. Draws (see :func:`fulcrum.core.vision.base.draw_machine`): one
``rng.integers`` over the live machines, plus one over the eligible machines only if the
first machine had no room. Cost: O(GPUs per machine); one vectorised O(G) pass only when
the first machine drawn is full.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from fulcrum.core.vision.base import Checked, Chosen, draw_machine
from fulcrum.core.vision.fleet import VisionFleet

NAME: Final = "random_machine"


class RandomMachine(Checked, name=NAME):
    """Uniformly random eligible machine, then its least-loaded eligible GPU."""

    __slots__ = ()

    def choose(self, fleet: VisionFleet, patches: int, rng: np.random.Generator) -> Chosen:
        return draw_machine(fleet, patches, rng)
