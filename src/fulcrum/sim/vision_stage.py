"""The simulator's vision-encoder stage: VE GPUs, the VE policy placing each image, and
each GPU's FIFO of images (an image of ``p`` patches takes ``v0 + v1 x p`` ns).

Driven by :class:`fulcrum.sim.engine.Simulator` (the *host*: virtual clock ``now`` (ns),
per-request ``images_left`` and ``ve_done`` (ns), the event heap ``_push``, and
``_prefill_ready`` once a request's last image is encoded).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

import numpy as np
import numpy.typing as npt

from fulcrum.sim.cluster import VisionCluster
from fulcrum.sim.events import VE_DONE
from fulcrum.sim.policies import VisionChooser
from fulcrum.sim.stats import Series


class Host(Protocol):
    """What the vision stage reads and writes of the simulator."""

    now: int
    images_left: list[int]
    ve_done: npt.NDArray[np.int64]

    def _push(self, t: int, kind: int, arg: int) -> None: ...

    def _prefill_ready(self, rid: int) -> None: ...


class VisionStage:
    """VE GPUs' patches and images in flight and their image queues."""

    def __init__(self, host: Host, cfg: VisionCluster, policy: str,
                 rng: np.random.Generator) -> None:
        self.host = host
        self.cfg = cfg
        self.rng = rng
        n = cfg.n_gpus
        self.patches = np.zeros(n, dtype=np.int64)
        self.images = np.zeros(n, dtype=np.int64)
        self.queue: list[deque[tuple[int, int]]] = [deque() for _ in range(n)]
        self.busy = [False] * n
        self.chooser = VisionChooser(policy, cfg.machines, cfg.gpus_per_machine)
        #: Max / mean patches in flight at each placement.
        self.imbalance = Series()

    def place(self, rid: int, patches: int) -> None:
        """Place one image of request ``rid`` (``patches`` patches) on a VE GPU."""
        g = self.chooser.choose(self.patches, self.images, patches, self.rng)
        self.patches[g] += patches
        self.images[g] += 1
        mean = float(self.patches.mean())
        if mean > 0:
            self.imbalance.add(self.host.now, float(self.patches.max()) / mean)
        self.queue[g].append((rid, patches))
        if not self.busy[g]:
            self._start(g)

    def _start(self, g: int) -> None:
        if not self.queue[g]:
            self.busy[g] = False
            return
        _, patches = self.queue[g][0]
        v = self.cfg
        self.busy[g] = True
        self.host._push(self.host.now + max(1, math.ceil(v.v0_ns + v.v1_ns * patches)),
                        VE_DONE, g)

    def done(self, g: int) -> None:
        """GPU ``g`` finished its head image."""
        host = self.host
        rid, patches = self.queue[g].popleft()
        self.patches[g] -= patches
        self.images[g] -= 1
        host.images_left[rid] -= 1
        if host.images_left[rid] == 0:
            host.ve_done[rid] = host.now
            host._prefill_ready(rid)
        self._start(g)
