"""Admission control: answer RESOURCE_EXHAUSTED with a retry hint while the daemon can
still answer, instead of letting calls queue until gRPC's transport times them out.

Every call (health and reflection excepted) belongs to one method class:

- ``control``: what keeps the fleet alive and engines busy (fleet Register, Heartbeat and
  Deregister, prefill Pull, ReportStepTimes and GetCostModel, EPLB group calls, VE machine
  load, the releases of placements, which only free capacity, and the no-op Ping);
- ``placement``: the entrypoint's placements (prefill Submit, PlaceDecode, PlaceImages and
  their streams);
- ``admin``: listings, forced rebalances, group status.

Two bounds, both checked when a call enters the shell (before its handler runs):

1. a bound on concurrent calls per class (``server.admission.max_<class>``);
2. the event loop's lateness: a ticker measures how late the loop runs (smoothed; decays by
   half each tick once the loop catches up). While it is above
   ``server.admission.shed_lag_ms``, new *placement* calls are refused at once; control
   and admin calls are not. Refusing costs far less loop time than placing, so the queue
   in front of the loop drains and health checks, pulls and heartbeats keep their latency.

A refusal ends RESOURCE_EXHAUSTED with ``retry-after-ms`` (at least
``server.admission.retry_after_ms``; twice the lateness when the loop is late) and is
counted in ``fulcrum_rpc_shed_total{class, reason}``. Every setting is reloadable.
"""

from __future__ import annotations

import asyncio
from typing import Final

from fulcrum.config.server import AdmissionSettings
from fulcrum.metrics import RPC_SHED

CONTROL: Final = "control"
PLACEMENT: Final = "placement"
ADMIN: Final = "admin"
CLASSES: Final = (CONTROL, PLACEMENT, ADMIN)

_PLACEMENT_METHODS: Final = frozenset({
    "/fulcrum.v1.PrefillBalancerService/Submit",
    "/fulcrum.v1.DecodeBalancerService/PlaceDecode",
    "/fulcrum.v1.DecodeBalancerService/PlaceDecodeStream",
    "/fulcrum.v1.VisionBalancerService/PlaceImages",
    "/fulcrum.v1.VisionBalancerService/PlaceImagesStream",
})
_ADMIN_METHODS: Final = frozenset({
    "/fulcrum.v1.FleetService/ListMembers",
    "/fulcrum.v1.ExpertBalancerService/Rebalance",
    "/fulcrum.v1.ExpertBalancerService/GetGroupStatus",
})

#: Period of the lateness ticker, seconds.
TICK_S: Final = 0.01


def class_of(method: str) -> str:
    """The method class of a full method name (``/package.Service/Method``)."""
    if method in _PLACEMENT_METHODS:
        return PLACEMENT
    if method in _ADMIN_METHODS:
        return ADMIN
    return CONTROL


class Admission:
    """Concurrent calls per class and the loop's lateness. Touched only on the loop."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self.in_flight: dict[str, int] = dict.fromkeys(CLASSES, 0)
        #: Smoothed lateness of the event loop, seconds.
        self.lag_s = 0.0
        self._limits = self._limits_of(settings)

    @staticmethod
    def _limits_of(s: AdmissionSettings) -> dict[str, int]:
        return {CONTROL: s.max_control, PLACEMENT: s.max_placement, ADMIN: s.max_admin}

    def apply_settings(self, settings: AdmissionSettings) -> None:
        """Take reloaded settings (every key applies at once)."""
        self.settings = settings
        self._limits = self._limits_of(settings)

    def admit(self, cls: str) -> int | None:
        """Count a call of ``cls`` in, or return the retry hint (ms) of a refusal."""
        s = self.settings
        if s.enabled:
            reason = None
            if self.in_flight[cls] >= self._limits[cls]:
                reason = "concurrency"
            elif cls == PLACEMENT and self.lag_s * 1000 > s.shed_lag_ms:
                reason = "loop_lag"
            if reason is not None:
                RPC_SHED.labels(cls, reason).inc()
                return max(s.retry_after_ms, int(2000 * self.lag_s))
        self.in_flight[cls] += 1
        return None

    def release(self, cls: str) -> None:
        self.in_flight[cls] = max(0, self.in_flight[cls] - 1)

    def observe_lag(self, late_s: float) -> None:
        """One lateness sample of the ticker, seconds."""
        self.lag_s = max(late_s, self.lag_s * 0.5)

    async def watch_loop(self) -> None:
        """Measure the loop's lateness forever (spawned by the server)."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(TICK_S)
            self.observe_lag(max(0.0, loop.time() - t0 - TICK_S))
