"""Prometheus collectors of the decode balancer, on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``policy`` is a registered decode policy name (6), ``branch`` is
"short", "long" or "" (dual's branch), ``outcome`` and ``reason`` come from fixed sets,
``instance``/``gpu`` are bounded by the fleet size and disappear with the instance. The
per-GPU gauges and the imbalances are read from the daemon's state at scrape time, so a
placement costs no gauge update.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fulcrum.metrics import REGISTRY

#: Outcomes of a PlaceDecode call (unary or streamed).
PLACE_OUTCOMES = ("placed", "invalid_argument", "already_exists", "resource_exhausted")
#: Outcomes of a ReleaseDecode call.
RELEASE_OUTCOMES = ("released", "invalid_argument", "not_found")

PLACEMENTS = Counter(
    "fulcrum_decode_placements",
    "PlaceDecode calls (unary or streamed), by policy, dual branch (short, long, or empty) "
    "and outcome (placed, invalid_argument, already_exists, resource_exhausted).",
    ["policy", "branch", "outcome"],
    registry=REGISTRY,
)
RELEASES = Counter(
    "fulcrum_decode_releases",
    "ReleaseDecode calls (unary or streamed), by outcome (released, invalid_argument, not_found).",
    ["outcome"],
    registry=REGISTRY,
)
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


class _ScrapeCollector(Collector):
    """Per-GPU concurrency and KV and the imbalances, read from the current source."""

    def __init__(self) -> None:
        self._source: weakref.ReferenceType[DecodeSource] | None = None

    def set_source(self, source: DecodeSource) -> None:
        self._source = weakref.ref(source)

    def _families(
        self,
    ) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "fulcrum_decode_gpu_concurrency",
                "Requests on each decode GPU (last report plus placements since, minus releases).",
                labels=["instance", "gpu"],
            ),
            GaugeMetricFamily(
                "fulcrum_decode_gpu_kv_tokens",
                "Total KV on each decode GPU, tokens (last report plus placements since, "
                "minus releases).",
                labels=["instance", "gpu"],
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
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        conc, kv, imbalance, held = self._families()
        source = self._source() if self._source is not None else None
        if source is not None:
            for instance, gpu, c, k in source.gpu_loads():
                conc.add_metric([instance, str(gpu)], float(c))
                kv.add_metric([instance, str(gpu)], float(k))
            imb_c, imb_k = source.imbalance()
            imbalance.add_metric([source.policy_name, "concurrency"], imb_c)
            imbalance.add_metric([source.policy_name, "kv_tokens"], imb_k)
            held.add_metric([], float(source.held))
        yield conc
        yield kv
        yield imbalance
        yield held


SCRAPE = _ScrapeCollector()
REGISTRY.register(SCRAPE)


def set_source(source: DecodeSource) -> None:
    """Make ``source`` (the daemon's decode state; held weakly) feed the scrape-time gauges."""
    SCRAPE.set_source(source)
