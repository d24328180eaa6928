"""Prometheus collectors of the vision-encoder (VE) balancer, on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``policy`` is a registered VE policy name (3), ``outcome`` and
``reason`` come from fixed sets, ``machine`` is bounded by the fleet's member bound and
``gpu`` series by ``vision.metrics_gpu_series``: per-GPU patches in flight are exported
for every GPU while the VE fleet has at most that many GPUs, else for that many most
loaded GPUs; per-machine sums and the balancer's summaries are always exported.

One owner: the scrape thread never reads the daemon's live state, only the immutable
:class:`VisionSnapshot` the event loop publishes after changes
(:class:`fulcrum.state.placement.Publisher`); imbalance, sums and top-k are computed
here, in the scrape thread, from that snapshot.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fulcrum.metrics import REGISTRY
from fulcrum.metrics.placement import (
    YIELD_EVERY,
    gpu_rows,
    imbalance_of,
    member_sums,
    yield_gil,
)
from fulcrum.state.placement import MemberTable

#: Outcomes of a PlaceImages request.
PLACE_OUTCOMES = ("placed", "invalid_argument", "already_exists", "resource_exhausted")
#: Outcomes of a ReleaseImages request.
RELEASE_OUTCOMES = ("released", "invalid_argument", "not_found")

EXPIRATIONS = Counter(
    "fulcrum_vision_expirations",
    "Placed requests whose lease ran out before they were released.",
    registry=REGISTRY,
)
EXPIRED_IMAGES = Counter(
    "fulcrum_vision_expired_images",
    "Images freed by lease expiry.",
    registry=REGISTRY,
)
LOST_IMAGES = Counter(
    "fulcrum_vision_lost_placements",
    "Placed images lost because their VE machine left, by reason (deregistered, lapsed, "
    "replaced).",
    ["reason"],
    registry=REGISTRY,
)
#: The placement table's name for it (placements lost with a member).
LOST = LOST_IMAGES


@dataclass(slots=True)
class VisionCounts:
    """Per-call counters kept as plain ints by the state (on the loop); the published
    snapshot carries a copy."""

    #: (policy, outcome) -> PlaceImages requests; outcome in :data:`PLACE_OUTCOMES`.
    placements: dict[tuple[str, str], int] = field(default_factory=dict)
    #: policy -> images placed.
    images: dict[str, int] = field(default_factory=dict)
    #: policy -> patches placed.
    patches: dict[str, int] = field(default_factory=dict)
    #: outcome -> ReleaseImages requests; outcome in :data:`RELEASE_OUTCOMES`.
    releases: dict[str, int] = field(default_factory=dict)


class VisionSnapshot(NamedTuple):
    """What the scrape thread reads: published by the loop, never written after."""

    policy: str = ""
    held: int = 0
    #: Per-GPU series bound (``vision.metrics_gpu_series``).
    gpu_series: int = 0
    #: Per machine: ``values = (patches_in_flight,)``, shape ``(gpus,)``.
    members: MemberTable = MemberTable()
    placements: tuple[tuple[tuple[str, str], int], ...] = ()
    images: tuple[tuple[str, int], ...] = ()
    patches: tuple[tuple[str, int], ...] = ()
    releases: tuple[tuple[str, int], ...] = ()


class SnapshotSource(Protocol):
    @property
    def snapshot(self) -> VisionSnapshot: ...


class _ScrapeCollector(Collector):
    """Per-GPU (bounded) and per-machine patches in flight, imbalance and counters."""

    def __init__(self) -> None:
        self._source: weakref.ReferenceType[SnapshotSource] | None = None

    def set_source(self, source: SnapshotSource) -> None:
        self._source = weakref.ref(source)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                "fulcrum_vision_gpu_patches_in_flight",
                "Image patches in flight on each VE GPU (last report plus placements since, "
                "minus releases); every GPU up to vision.metrics_gpu_series GPUs, else the "
                "most loaded ones.",
                labels=["machine", "gpu"],
            ),
            GaugeMetricFamily(
                "fulcrum_vision_machine_patches_in_flight",
                "Image patches in flight on all GPUs of each VE machine.",
                labels=["machine"],
            ),
            GaugeMetricFamily("fulcrum_vision_gpus", "VE GPUs in placement (all machines)."),
            GaugeMetricFamily(
                "fulcrum_vision_imbalance",
                "Max over mean of patches in flight across live VE GPUs (1.0 = perfect), "
                "by the policy in force.",
                labels=["policy"],
            ),
            GaugeMetricFamily(
                "fulcrum_vision_placements_held",
                "Placed requests held (not yet released or expired).",
            ),
            CounterMetricFamily(
                "fulcrum_vision_placements",
                "PlaceImages requests (unary or streamed), by policy and outcome (placed, "
                "invalid_argument, already_exists, resource_exhausted).",
                labels=["policy", "outcome"],
            ),
            CounterMetricFamily(
                "fulcrum_vision_images_placed",
                "Images placed on VE GPUs, by policy.",
                labels=["policy"],
            ),
            CounterMetricFamily(
                "fulcrum_vision_patches_placed",
                "Image patches placed on VE GPUs, by policy.",
                labels=["policy"],
            ),
            CounterMetricFamily(
                "fulcrum_vision_releases",
                "ReleaseImages requests (unary or streamed), by outcome (released, "
                "invalid_argument, not_found).",
                labels=["outcome"],
            ),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        fams = self._families()
        gpus, per_machine, n_gpus_f, imbalance, held, placements, images, patches, releases = (
            fams
        )
        source = self._source() if self._source is not None else None
        if source is not None:
            snap = source.snapshot
            members = sorted(snap.members, key=lambda m: m.member_id)
            sums = member_sums(members, 0)
            for i, m in enumerate(members):
                per_machine.add_metric([m.member_id], float(sums[i]))
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    yield_gil()
            n_gpus_f.add_metric([], float(sum(int(m.values[0].shape[0]) for m in members)))
            rows = gpu_rows(members, snap.gpu_series, lambda v: v[0])
            for i, (machine, gpu, (value,)) in enumerate(rows):
                gpus.add_metric([machine, str(gpu)], float(value))
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    yield_gil()
            imbalance.add_metric([snap.policy], imbalance_of([m.values[0] for m in members]))
            held.add_metric([], float(snap.held))
            for (policy, outcome), n in sorted(snap.placements):
                placements.add_metric([policy, outcome], float(n))
            for policy, n in sorted(snap.images):
                images.add_metric([policy], float(n))
            for policy, n in sorted(snap.patches):
                patches.add_metric([policy], float(n))
            for outcome, n in sorted(snap.releases):
                releases.add_metric([outcome], float(n))
        yield from fams


SCRAPE = _ScrapeCollector()
REGISTRY.register(SCRAPE)


def set_source(source: SnapshotSource) -> None:
    """Make ``source`` (the daemon's VE snapshot publisher; held weakly) feed the
    scrape-time gauges."""
    SCRAPE.set_source(source)
