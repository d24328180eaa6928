"""Prometheus collectors of the decode balancer, on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``policy`` is a registered decode policy name (6), ``branch`` is
"short", "long" or "" (dual's branch), ``outcome`` and ``reason`` come from fixed sets,
``decode_instance``/``gpu`` are bounded by the fleet size and disappear with the instance. The
per-GPU gauges, the imbalances and the placement/release counters are read from the
daemon's state at scrape time, so a placement costs no collector update (the counters
are plain ints in :class:`DecodeCounts`: no lock, no label lookup on the decision path).
The scrape source is the latest daemon state created in the process (one daemon per
process in production).
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

#: Outcomes of a PlaceDecode call (unary or streamed).
PLACE_OUTCOMES = ("placed", "invalid_argument", "already_exists", "resource_exhausted")
#: Outcomes of a ReleaseDecode call.
RELEASE_OUTCOMES = ("released", "invalid_argument", "not_found")

EXPIRATIONS = Counter(
    "fulcrum_decode_expirations",
    "Placements whose lease ran out before they were released.",
    registry=REGISTRY,
)
LOST = Counter(
    "fulcrum_decode_lost_placements",
    "Placements lost because their decode instance left, by reason (deregistered, lapsed, "
    "replaced).",
    ["reason"],
    registry=REGISTRY,
)


@dataclass(slots=True)
class DecodeCounts:
    """Per-call counters kept as plain ints by the state and exported at scrape time."""

    #: (policy, branch, outcome) -> PlaceDecode calls; outcome in :data:`PLACE_OUTCOMES`.
    placements: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: outcome -> ReleaseDecode calls; outcome in :data:`RELEASE_OUTCOMES`.
    releases: dict[str, int] = field(default_factory=dict)


class DecodeSource(Protocol):
    """What the scrape-time collector reads from the daemon's decode state."""

    @property
    def policy_name(self) -> str: ...

    def gpu_loads(self) -> Iterable[tuple[str, int, int, int]]:
        """``(instance_id, gpu_index, concurrency, kv_tokens)`` of every decode GPU."""
        ...

    def imbalance(self) -> tuple[float, float]:
        """Max over mean across decode GPUs of (concurrency, total KV); 1.0 = perfect."""
        ...

    @property
    def held(self) -> int:
        """Placements held (not yet released, expired or lost)."""
        ...

    @property
    def counts(self) -> DecodeCounts: ...


_Families = tuple[
    GaugeMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
]


class _ScrapeCollector(Collector):
    """Per-GPU concurrency and KV and the imbalances, read from the current source."""

    def __init__(self) -> None:
        self._source: weakref.ReferenceType[DecodeSource] | None = None

    def set_source(self, source: DecodeSource) -> None:
        self._source = weakref.ref(source)

    def _families(self) -> _Families:
        return (
            GaugeMetricFamily(
                "fulcrum_decode_gpu_concurrency",
                "Requests on each decode GPU (last report plus placements since, minus releases).",
                labels=["decode_instance", "gpu"],
            ),
            GaugeMetricFamily(
                "fulcrum_decode_gpu_kv_tokens",
                "Total KV on each decode GPU, tokens (last report plus placements since, "
                "minus releases).",
                labels=["decode_instance", "gpu"],
            ),
            GaugeMetricFamily(
                "fulcrum_decode_imbalance",
                "Max over mean across decode GPUs (1.0 = perfect), by dimension "
                "(concurrency, kv_tokens) and the policy in force.",
                labels=["policy", "dimension"],
            ),
            GaugeMetricFamily(
                "fulcrum_decode_placements_held",
                "Placements held (not yet released, expired or lost).",
            ),
            CounterMetricFamily(
                "fulcrum_decode_placements",
                "PlaceDecode calls (unary or streamed), by policy, dual branch (short, long, "
                "or empty) and outcome (placed, invalid_argument, already_exists, "
                "resource_exhausted).",
                labels=["policy", "branch", "outcome"],
            ),
            CounterMetricFamily(
                "fulcrum_decode_releases",
                "ReleaseDecode calls (unary or streamed), by outcome (released, "
                "invalid_argument, not_found).",
                labels=["outcome"],
            ),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        fams = self._families()
        conc, kv, imbalance, held, placements, releases = fams
        source = self._source() if self._source is not None else None
        if source is not None:
            for instance, gpu, c, k in source.gpu_loads():
                conc.add_metric([instance, str(gpu)], float(c))
                kv.add_metric([instance, str(gpu)], float(k))
            imb_c, imb_k = source.imbalance()
            imbalance.add_metric([source.policy_name, "concurrency"], imb_c)
            imbalance.add_metric([source.policy_name, "kv_tokens"], imb_k)
            held.add_metric([], float(source.held))
            counts = source.counts
            for labels, n in sorted(counts.placements.items()):
                placements.add_metric(list(labels), float(n))
            for outcome, n in sorted(counts.releases.items()):
                releases.add_metric([outcome], float(n))
        yield from fams


SCRAPE = _ScrapeCollector()
REGISTRY.register(SCRAPE)


def set_source(source: DecodeSource) -> None:
    """Make ``source`` (the daemon's decode state; held weakly) feed the scrape-time gauges."""
    SCRAPE.set_source(source)
