"""The simulator's tenants (issue 23): request classes, shedding, per-request compute.

The classes come from the daemon's own :class:`fulcrum.core.tenants.TenantTable` over
the cluster's ``tenants`` settings; the shed decision is the core's
(:func:`fulcrum.core.prefill.shed.shed_check`), the queue order the balancer's own
order rule. This stage only keeps the per-request arrays the report reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from fulcrum.core.cost import CostModel
from fulcrum.core.prefill.balancer import PrefillBalancer, Queued
from fulcrum.core.prefill.chunks import PrefillTask, StepPlan, band_loads
from fulcrum.core.prefill.shed import shed_check
from fulcrum.core.tenants import RequestClass, TenantPolicy, TenantTable
from fulcrum.errors import FulcrumError

if TYPE_CHECKING:
    from fulcrum.sim.workload import Request


class TenantStage:
    """Per request: its class, whether it was shed, when the balancer handed it to an
    engine (ns, -1: never) and its useful prefill compute (ns)."""

    def __init__(self, policy: TenantPolicy, reqs: Sequence[Request]) -> None:
        self.table = TenantTable(policy)
        self.classes: list[RequestClass] = []
        for i, r in enumerate(reqs):
            try:
                self.classes.append(self.table.resolve(r.tenant, r.priority, r.ttft_slo_ms))
            except FulcrumError as err:
                raise ValueError(f"request {i} (arrival {r.arrival_ns} ns): "
                                 f"{err.message}") from None
        #: True when the requests come in more than one priority band, or from more than
        #: one tenant (fair-share precedence splits a band on the ranks).
        self.banded = (len({c.priority for c in self.classes}) > 1
                       or len({c.tenant for c in self.classes}) > 1)
        n = len(reqs)
        self.shed = np.zeros(n, dtype=np.bool_)
        self.taken_ns: npt.NDArray[np.int64] = np.full(n, -1, dtype=np.int64)
        self.useful_ns: npt.NDArray[np.float64] = np.zeros(n, dtype=np.float64)

    def band_loads(self, queues: Sequence[Iterable[PrefillTask]],
                   model: CostModel) -> dict[float, list[int]] | None:
        """An engine's work per band held and rank (ns; ``queues``: its ranks' queues), as
        an engine running the kit reports it with its pull; None when the workload has one
        band (nothing to say)."""
        return band_loads(queues, model) if self.banded else None

    def whole_loads(self, queues: Sequence[Iterable[PrefillTask]],
                    model: CostModel) -> list[int] | None:
        """An engine's rank loads (ns) as the kit reports them beside its band loads (the
        lowest band's row, the same sums); None when the workload has one band."""
        bands = self.band_loads(queues, model)
        return bands[min(bands)] if bands else None

    def refuse(self, bal: PrefillBalancer, item: Queued, elapsed_ns: int) -> bool:
        """True when the core sheds ``item`` (then it is marked and never queued)."""
        intent = shed_check(bal, item, self.table.sheddable(item.cls), elapsed_ns)
        if intent is None:
            return False
        self.shed[int(item.request_id)] = True
        return True

    def taken(self, items: Sequence[Queued], now_ns: int) -> None:
        """The balancer handed ``items`` to an engine at ``now_ns``."""
        for it in items:
            self.taken_ns[int(it.request_id)] = now_ns

    def step(self, plan: StepPlan) -> None:
        """Add each chunk's useful cost (ns, without ``k``) of a step to its request."""
        for chunks in plan.chunks:
            for ch in chunks:
                self.useful_ns[int(ch.request_id)] += ch.cost_ns
