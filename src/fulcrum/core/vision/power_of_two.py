"""``power_of_two``: two random machines, the less loaded one wins (comparison baseline).

Rule: draw two distinct VE machines uniformly at random with the injected generator
among the machines with at least one eligible GPU (live, with room for the image's
patches when a capacity is set); see
:func:`fulcrum.core.vision.base.draw_two_machines` for the exact draws. The machine with
fewer patches in flight per live GPU wins, compared exactly as
``load_a * gpus_b < load_b * gpus_a`` (for equal-sized machines: fewer patches in
flight); a tie goes to the lower machine index. A single eligible machine is taken as
is. The image then goes to the winner's eligible GPU with the fewest patches in flight,
ties to the lowest GPU index. Cost: O(GPUs of the two machines).
"""

from __future__ import annotations

from typing import Final

import numpy as np

from fulcrum.core.vision.base import Checked, Chosen, draw_two_machines
from fulcrum.core.vision.fleet import NoCapacity, VisionFleet

NAME: Final = "power_of_two"


class PowerOfTwo(Checked, name=NAME):
    """Less loaded (per live GPU) of two random eligible machines, then its best GPU."""

    __slots__ = ()

    def choose(self, fleet: VisionFleet, patches: int, rng: np.random.Generator) -> Chosen:
        drawn = draw_two_machines(fleet, patches, rng)
        if isinstance(drawn, NoCapacity) or len(drawn) == 1:
            return drawn if isinstance(drawn, NoCapacity) else drawn[0]
        (a, ga), (b, gb) = sorted(drawn)
        gpus = fleet.topology.live_gpus_list
        load_a = fleet.machine_load(a) * gpus[b]
        load_b = fleet.machine_load(b) * gpus[a]
        return (b, gb) if load_b < load_a else (a, ga)
