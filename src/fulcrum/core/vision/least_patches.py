"""``least_patches``: the globally least-loaded GPU (comparison baseline).

Rule: over every eligible GPU of the fleet (live, with room for the image's patches when
a capacity is set), the one with the fewest patches in flight; ties to the lowest global
GPU index (machines in registration order, GPUs in their order). No randomness: the
generator is not drawn from. Cost: one vectorised O(G) pass.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from fulcrum.core.vision.base import Checked, Chosen, no_fit_reason
from fulcrum.core.vision.fleet import NO_LIMIT, NoCapacity, VisionFleet

NAME: Final = "least_patches"


class LeastPatches(Checked, name=NAME):
    """Global argmin of patches in flight over eligible GPUs."""

    __slots__ = ()

    def choose(self, fleet: VisionFleet, patches: int, rng: np.random.Generator) -> Chosen:
        t = fleet.topology
        load = fleet.patches_in_flight
        if t.n_gpus == 0:
            return NoCapacity(no_fit_reason(fleet, patches))
        if t.unlimited and t.all_live:
            gpu = int(load.argmin())
        else:
            fits = load + patches <= t.limit
            gpu = int(np.where(fits, load, NO_LIMIT).argmin())
            if not fits[gpu]:
                return NoCapacity(no_fit_reason(fleet, patches))
        return int(t.gpu_machine[gpu]), gpu
