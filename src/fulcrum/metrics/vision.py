"""Prometheus collectors of the vision-encoder (VE) balancer, on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``policy`` is a registered VE policy name (3), ``outcome`` and
``reason`` come from fixed sets, ``machine``/``gpu`` are bounded by the fleet size (and
disappear with the machine). Everything that changes per call (per-GPU patches in
flight, imbalance, placements held, placement/release counters) is read from the
daemon's state at scrape time, so a decision costs no collector update. The scrape
source is the latest daemon state created in the process (one daemon per process in
production).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fulcrum.metrics import REGISTRY

#: Outcomes of a PlaceImages request.
PLACE_OUTCOMES = ("placed", "invalid_argument", "already_exists", "resource_exhausted")

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

@dataclass(slots=True)
class VisionCounts:
    """Per-call counters kept as plain ints by the state (no lock, no label lookup on the
    decision path) and exported at scrape time."""

    #: (policy, outcome) -> PlaceImages requests; outcome in :data:`PLACE_OUTCOMES`.
    placements: dict[tuple[str, str], int] = field(default_factory=dict)
    #: policy -> images placed.
    images: dict[str, int] = field(default_factory=dict)
    #: policy -> patches placed.
    patches: dict[str, int] = field(default_factory=dict)
    #: outcome (released, not_found) -> ReleaseImages requests.
    releases: dict[str, int] = field(default_factory=dict)


class VisionSource(Protocol):
    """What the scrape-time collector reads from the daemon's VE state."""

    @property
    def policy_name(self) -> str: ...

    def gpu_loads(self) -> Iterable[tuple[str, int, int]]:
        """``(machine_id, gpu_index, patches_in_flight)`` of every GPU."""
        ...

    def imbalance(self) -> float:
        """Max over mean of patches in flight across live GPUs (1.0 = perfect)."""
        ...

    @property
    def held(self) -> int:
        """Placed requests held."""
        ...

    @property
    def counts(self) -> VisionCounts: ...


_Families = tuple[
    GaugeMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
]


class _ScrapeCollector(Collector):
    """Per-GPU patches in flight and the imbalance, read from the current source."""

    def __init__(self) -> None:
        self._source: weakref.ReferenceType[VisionSource] | None = None

    def set_source(self, source: VisionSource) -> None:
        self._source = weakref.ref(source)

    def _families(self) -> _Families:
        return (
            GaugeMetricFamily(
                "fulcrum_vision_gpu_patches_in_flight",
                "Image patches in flight on each VE GPU (last report plus placements since, "
                "minus releases).",
                labels=["machine", "gpu"],
            ),
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
                "ReleaseImages requests (unary or streamed), by outcome (released, not_found).",
                labels=["outcome"],
            ),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        fams = self._families()
        gpus, imbalance, held, placements, images, patches, releases = fams
        source = self._source() if self._source is not None else None
        if source is not None:
            for machine, gpu, value in source.gpu_loads():
                gpus.add_metric([machine, str(gpu)], float(value))
            imbalance.add_metric([source.policy_name], source.imbalance())
            held.add_metric([], float(source.held))
            counts = source.counts
            for (policy, outcome), n in sorted(counts.placements.items()):
                placements.add_metric([policy, outcome], float(n))
            for policy, n in sorted(counts.images.items()):
                images.add_metric([policy], float(n))
            for policy, n in sorted(counts.patches.items()):
                patches.add_metric([policy], float(n))
            for outcome, n in sorted(counts.releases.items()):
                releases.add_metric([outcome], float(n))
        yield from fams


SCRAPE = _ScrapeCollector()
REGISTRY.register(SCRAPE)


def set_source(source: VisionSource) -> None:
    """Make ``source`` (the daemon's VE state; held weakly) feed the scrape-time gauges."""
    SCRAPE.set_source(source)
