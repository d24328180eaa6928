"""The filter step in front of any VE policy: choose among allowed GPUs only (pure).

:func:`restrict` gives the view of a fleet in which only the GPUs of a boolean mask
(shape ``(G,)``) can take an image: the others look dead to every policy (their limit is
-1, they count as not live, a machine without an allowed GPU is not drawn). The policies
run unchanged on it, so a pick is always an allowed, live GPU with room. The daemon's
table applies its filter list (:class:`fulcrum.state.placement.SlotFilter`) this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fulcrum.core.vision.fleet import _DEAD_LIMIT, I64, Topology, VisionFleet

BoolArr = npt.NDArray[np.bool_]

__all__ = ["MaskedTopology", "restrict"]


@dataclass(frozen=True, slots=True)
class MaskedTopology:
    """A :class:`fulcrum.core.vision.fleet.Topology` whose GPUs outside a mask are dead
    (built by :func:`restrict`; arrays of shape ``(G,)``, lists of length ``M``)."""

    machine_ids: Sequence[str]
    starts: Sequence[int]
    ends: Sequence[int]
    live_machine_list: Sequence[int]
    all_live_list: Sequence[bool]
    live_gpus_list: Sequence[int]
    limit: I64
    live: BoolArr
    gpu_machine: I64

    @property
    def unlimited(self) -> bool:
        return False  # the dead GPUs carry a limit the policies must check

    @property
    def all_live(self) -> bool:
        return bool(self.live.all())

    @property
    def n_machines(self) -> int:
        return len(self.machine_ids)

    @property
    def n_gpus(self) -> int:
        return int(self.limit.shape[0])


def restrict(fleet: VisionFleet, allowed: BoolArr) -> VisionFleet:
    """``fleet`` with only the GPUs of ``allowed`` (a boolean mask, shape ``(G,)``) able to
    take an image. O(G); ``fleet`` is untouched (the patches in flight are shared).

    Raises:
        ValueError: ``allowed`` is not a boolean mask of shape ``(G,)``.
    """
    t: Topology = fleet.topology
    if allowed.dtype != np.bool_ or allowed.shape != (t.n_gpus,):
        raise ValueError(f"allowed: must be a boolean mask of shape ({t.n_gpus},)")
    live = np.logical_and(t.live, allowed)
    starts, ends = t.starts, t.ends
    gpus = [ends[m] - starts[m] for m in range(t.n_machines)]
    per_machine = [int(live[starts[m] : ends[m]].sum()) for m in range(t.n_machines)]
    masked = MaskedTopology(
        machine_ids=t.machine_ids,
        starts=t.starts,
        ends=t.ends,
        live_machine_list=[m for m in t.live_machine_list if per_machine[m] > 0],
        all_live_list=[0 < n == g for n, g in zip(per_machine, gpus, strict=True)],
        live_gpus_list=per_machine,
        limit=np.where(live, t.limit, _DEAD_LIMIT),
        live=live,
        gpu_machine=t.gpu_machine,
    )
    return VisionFleet(masked, fleet.patches_in_flight)
