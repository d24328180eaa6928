"""Helpers shared by the VE core tests (imported as a sibling module)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st

from fulcrum.core.vision.fleet import MachineSpec, VisionFleet, VisionTopology


def uniform_topology(
    n_machines: int, gpus_per_machine: int, *, max_patches: int = 0
) -> VisionTopology:
    """``n_machines`` machines ``m0..`` with GPUs ``0..gpus_per_machine-1`` each."""
    return VisionTopology.build(
        [
            MachineSpec(f"m{i}", tuple(range(gpus_per_machine)), max_patches=max_patches)
            for i in range(n_machines)
        ]
    )


def fleet_with(topology: VisionTopology, loads: Sequence[int]) -> VisionFleet:
    """``topology`` with the given patches in flight per global GPU index."""
    return VisionFleet(topology, np.asarray(loads, dtype=np.int64))


# Image mix of the simulation: (width, height) at patch size 16, with weights.
IMAGE_MIX: tuple[tuple[int, int, float], ...] = (
    (1280, 800, 0.4),  # screenshots: 4,000 patches
    (1920, 1080, 0.1),  # full-HD: 8,160 patches
    (512, 512, 0.3),  # thumbnails: 1,024 patches
    (256, 256, 0.2),  # icons: 256 patches
)


def simulate_imbalance(
    policy_name: str,
    *,
    n_machines: int = 32,
    gpus_per_machine: int = 8,
    ticks: int = 600,
    warmup: int = 100,
    utilisation: float = 0.8,
    rate: int = 2_000,
    seed: int = 1,
) -> float:
    """Time-averaged imbalance (max/mean patches in flight) of ``policy_name``.

    Discrete time; each GPU's encoder works its FIFO of images at ``rate`` patches per
    tick and releases an image when its last patch is encoded. Images arrive as a
    Poisson stream sized for ``utilisation`` of the fleet's encoding rate. Pure and
    seeded: arrivals use one generator, the policy another.
    """
    from collections import deque

    from fulcrum.core.vision.base import place_many
    from fulcrum.core.vision.fleet import imbalance, release
    from fulcrum.core.vision.patches import patches
    from fulcrum.core.vision.registry import make_policy

    topo = uniform_topology(n_machines, gpus_per_machine)
    fleet = VisionFleet.empty(topo)
    pol = make_policy(policy_name)
    arrivals = np.random.default_rng(seed)
    choices = np.random.default_rng(seed + 1)
    sizes = np.asarray([patches(w, h, 16) for w, h, _ in IMAGE_MIX], dtype=np.int64)
    weights = np.asarray([wt for _, _, wt in IMAGE_MIX])
    mean_patches = float(sizes @ weights)
    lam = utilisation * topo.n_gpus * rate / mean_patches  # images per tick
    queues: list[deque[list[int]]] = [deque() for _ in range(topo.n_gpus)]
    total = 0.0
    for tick in range(ticks):
        n = int(arrivals.poisson(lam))
        counts = [int(c) for c in arrivals.choice(sizes, size=n, p=weights)]
        placed, fleet = place_many(pol, fleet, counts, choices)
        for pl in placed:
            queues[pl.gpu].append([pl.patches, pl.patches])
        for g, q in enumerate(queues):
            budget = rate
            while q and budget > 0:
                head = q[0]
                used = min(budget, head[1])
                head[1] -= used
                budget -= used
                if head[1] == 0:
                    q.popleft()
                    fleet = release(fleet, g, head[0])
        if tick >= warmup:
            total += imbalance(fleet)
    return total / (ticks - warmup)


@st.composite
def fleets(draw: st.DrawFn) -> VisionFleet:
    n = draw(st.integers(1, 6))
    specs = []
    for i in range(n):
        gpus = draw(st.integers(1, 8))
        cap = draw(st.sampled_from([0, 0, draw(st.integers(1, 20_000))]))
        live = draw(st.booleans()) if n > 1 else True
        specs.append(MachineSpec(f"m{i}", tuple(range(gpus)), max_patches=cap, live=live))
    topo = VisionTopology.build(specs)
    loads = [draw(st.integers(0, int(c) if c > 0 else 20_000)) for c in topo.capacity.tolist()]
    return VisionFleet(topo, np.asarray(loads, dtype=np.int64))


def eligible(fleet: VisionFleet, p: int) -> npt.NDArray[np.bool_]:
    t = fleet.topology
    load = fleet.patches_in_flight
    return np.asarray(t.live & ((t.capacity == 0) | (load + p <= t.capacity)), dtype=np.bool_)
