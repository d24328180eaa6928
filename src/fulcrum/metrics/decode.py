"""Prometheus collectors of the decode balancer, on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``policy`` is a registered decode policy name (6), ``branch`` is
"short", "long" or "" (dual's branch), ``outcome`` and ``reason`` come from fixed sets,
``decode_instance`` is bounded by the fleet's member bound and ``gpu`` series by
``decode.metrics_gpu_series``: per-GPU gauges are exported for every GPU while the
decode fleet has at most that many GPUs, else for that many most loaded GPUs (most
requests, then most KV); per-instance sums and the balancer's summaries are always
exported. Series of an instance disappear with it.

One owner: the scrape thread never reads the daemon's live state. It reads the immutable
:class:`DecodeSnapshot` the event loop publishes after changes
(:class:`fulcrum.state.placement.Publisher`); everything derived (imbalance, sums, top-k)
is computed here, in the scrape thread, from that snapshot.
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
    """Per-call counters kept as plain ints by the state (on the loop); the published
    snapshot carries a copy."""

    #: (policy, branch, outcome) -> PlaceDecode calls; outcome in :data:`PLACE_OUTCOMES`.
    placements: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: outcome -> ReleaseDecode calls; outcome in :data:`RELEASE_OUTCOMES`.
    releases: dict[str, int] = field(default_factory=dict)


class DecodeSnapshot(NamedTuple):
    """What the scrape thread reads: published by the loop, never written after."""

    policy: str = ""
    held: int = 0
    #: Per-GPU series bound (``decode.metrics_gpu_series``).
    gpu_series: int = 0
    #: Per instance: ``values = (concurrency, kv_tokens)``, each of shape ``(gpus,)``.
    members: MemberTable = MemberTable()
    placements: tuple[tuple[tuple[str, str, str], int], ...] = ()
    releases: tuple[tuple[str, int], ...] = ()


class SnapshotSource(Protocol):
    @property
    def snapshot(self) -> DecodeSnapshot: ...


class _ScrapeCollector(Collector):
    """Per-GPU (bounded) and per-instance load, imbalance and counters from a snapshot."""

    def __init__(self) -> None:
        self._source: weakref.ReferenceType[SnapshotSource] | None = None

    def set_source(self, source: SnapshotSource) -> None:
        self._source = weakref.ref(source)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                "fulcrum_decode_gpu_concurrency",
                "Requests on each decode GPU (last report plus placements since, minus "
                "releases); every GPU up to decode.metrics_gpu_series GPUs, else the most "
                "loaded ones.",
                labels=["decode_instance", "gpu"],
            ),
            GaugeMetricFamily(
                "fulcrum_decode_gpu_kv_tokens",
                "Total KV on each decode GPU, tokens (same GPUs as "
                "fulcrum_decode_gpu_concurrency).",
                labels=["decode_instance", "gpu"],
            ),
            GaugeMetricFamily(
                "fulcrum_decode_instance_concurrency",
                "Requests on all GPUs of each decode instance.",
                labels=["decode_instance"],
            ),
            GaugeMetricFamily(
                "fulcrum_decode_instance_kv_tokens",
                "Total KV on all GPUs of each decode instance, tokens.",
                labels=["decode_instance"],
            ),
            GaugeMetricFamily(
                "fulcrum_decode_gpus",
                "Decode GPUs in placement (all instances).",
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
        conc, kv, inst_conc, inst_kv, gpus, imbalance, held, placements, releases = fams
        source = self._source() if self._source is not None else None
        if source is not None:
            snap = source.snapshot
            members = sorted(snap.members, key=lambda m: m.member_id)
            sums_c, sums_k = member_sums(members, 0), member_sums(members, 1)
            for i, m in enumerate(members):
                inst_conc.add_metric([m.member_id], float(sums_c[i]))
                inst_kv.add_metric([m.member_id], float(sums_k[i]))
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    yield_gil()
            gpus.add_metric([], float(sum(int(m.values[0].shape[0]) for m in members)))
            # Rank by requests, then KV (< 2^20 and < 2^40: see core.decode.view).
            rows = gpu_rows(members, snap.gpu_series, lambda v: v[0] * (1 << 40) + v[1])
            for i, (member_id, gpu, (gc, gk)) in enumerate(rows):
                conc.add_metric([member_id, str(gpu)], float(gc))
                kv.add_metric([member_id, str(gpu)], float(gk))
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    yield_gil()
            all_c = [m.values[0] for m in members]
            all_k = [m.values[1] for m in members]
            imbalance.add_metric([snap.policy, "concurrency"], imbalance_of(all_c))
            imbalance.add_metric([snap.policy, "kv_tokens"], imbalance_of(all_k))
            held.add_metric([], float(snap.held))
            for labels, n in sorted(snap.placements):
                placements.add_metric(list(labels), float(n))
            for outcome, n in sorted(snap.releases):
                releases.add_metric([outcome], float(n))
        yield from fams


SCRAPE = _ScrapeCollector()
REGISTRY.register(SCRAPE)


def set_source(source: SnapshotSource) -> None:
    """Make ``source`` (the daemon's decode snapshot publisher; held weakly) feed the
    scrape-time gauges."""
    SCRAPE.set_source(source)
