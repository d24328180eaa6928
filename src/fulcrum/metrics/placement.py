"""The one collector of the placement tables (decode, vision): run in the scrape thread
on published snapshots only (:class:`fulcrum.state.placement.TableSnapshot`), with
bounded per-GPU rows, per-member sums, imbalance and the call counters. Each balancer's
module names its families (:class:`TableMetrics`) and registers one
:func:`table_collector`.

One owner: the scrape thread never reads a table's live state, only the immutable
snapshot the event loop builds for the scrape
(:meth:`fulcrum.state.placement.Publisher.fresh`); everything derived (imbalance, sums,
top-k) is computed here, in the scrape thread, from that snapshot.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fulcrum.metrics import REGISTRY
from fulcrum.state.placement import MemberFigures, TableSnapshot

I64 = npt.NDArray[np.int64]


def imbalance_of(parts: Sequence[I64]) -> float:
    """max/mean over the concatenation of ``parts``; 1.0 when empty or all zero."""
    if not parts:
        return 1.0
    values = np.concatenate(parts)
    if values.size == 0:
        return 1.0
    total = int(values.sum())
    if total <= 0:
        return 1.0
    return float(int(values.max()) * values.size / total)


def gpu_rows(
    members: Sequence[MemberFigures],
    limit: int,
    rank: Callable[[tuple[I64, ...]], I64],
) -> Iterator[tuple[str, int, tuple[int, ...]]]:
    """``(member_id, gpu_index, figures)`` of every GPU when there are at most ``limit``,
    else of ``limit`` GPUs with the largest ``rank(values)`` (ties: any),
    in member then GPU order. ``members`` sorted by id; O(G) vectorised plus O(limit)."""
    sizes = [int(m.values[0].shape[0]) for m in members]
    total = sum(sizes)
    if total <= limit:
        for m in members:
            cols = [v.tolist() for v in m.values]
            for gpu, row in enumerate(zip(*cols, strict=True)):
                yield m.member_id, gpu, row
        return
    if limit <= 0:
        return
    key = np.concatenate([rank(m.values) for m in members])
    top = np.sort(np.argpartition(-key, limit - 1)[:limit])
    offsets = np.cumsum([0, *sizes])
    owner = np.searchsorted(offsets, top, side="right") - 1
    for pos, i in zip(top.tolist(), owner.tolist(), strict=True):
        m = members[i]
        gpu = pos - int(offsets[i])
        yield m.member_id, gpu, tuple(int(v[gpu]) for v in m.values)


#: Samples added between two yields of the GIL (see :func:`yield_gil`).
YIELD_EVERY = 256


def yield_gil() -> None:
    """Let the event loop's thread take the GIL now (a scrape of a large fleet is CPU
    work in the scrape thread; without yielding, the loop waits for the interpreter's
    switch interval at each of its GIL acquisitions)."""
    time.sleep(0)


def member_sums(members: Sequence[MemberFigures], which: int) -> list[int]:
    """Sum over each member's GPUs of figure ``which`` (one vectorised pass)."""
    if not members:
        return []
    values = np.concatenate([m.values[which] for m in members])
    sizes = [int(m.values[which].shape[0]) for m in members]
    starts = np.cumsum([0, *sizes[:-1]])
    sums: list[int] = np.add.reduceat(values, starts).tolist()
    return sums


# -- the one collector of a placement table ---------------------------------------------


Family = GaugeMetricFamily | CounterMetricFamily


@dataclass(frozen=True, slots=True)
class Spec:
    """One metric family of a table's collector: ``kind`` "gauge" or "counter"."""

    kind: str
    name: str
    doc: str
    labels: tuple[str, ...] = ()

    def build(self) -> Family:
        if self.kind == "gauge":
            return GaugeMetricFamily(self.name, self.doc, labels=list(self.labels))
        return CounterMetricFamily(self.name, self.doc, labels=list(self.labels))


@dataclass(frozen=True, slots=True)
class TableMetrics:
    """The families a placement table's snapshot feeds (built at every scrape).

    ``per_gpu`` and ``per_member`` have one family per figure of the snapshot's members
    (labels ``[member, gpu]`` and ``[member]``); ``imbalance`` is labelled by policy, and
    by dimension when ``dimensions`` names the figures; ``units`` are per-policy counters
    of the snapshot's ``units`` (in :attr:`TableKind.units` order); ``rank`` orders GPUs
    for the bounded per-GPU series (largest first).
    """

    per_gpu: tuple[Spec, ...]
    per_member: tuple[Spec, ...]
    gpus: Spec
    imbalance: Spec
    held: Spec
    placements: Spec
    releases: Spec
    rank: Callable[[tuple[I64, ...]], I64]
    dimensions: tuple[str, ...] = ()
    units: tuple[Spec, ...] = ()

    def specs(self) -> tuple[Spec, ...]:
        return (
            *self.per_gpu, *self.per_member, self.gpus, self.imbalance, self.held,
            self.placements, *self.units, self.releases,
        )


class SnapshotSource(Protocol):
    def fresh(self) -> TableSnapshot: ...


def _add_per_member(members: Sequence[MemberFigures], fams: Sequence[Family]) -> None:
    sums = [member_sums(members, which) for which in range(len(fams))]
    for i, m in enumerate(members):
        for fam, figure in zip(fams, sums, strict=True):
            fam.add_metric([m.member_id], float(figure[i]))
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            yield_gil()


def _add_per_gpu(
    members: Sequence[MemberFigures], spec: TableMetrics, limit: int, fams: Sequence[Family]
) -> None:
    for i, (member_id, gpu, row) in enumerate(gpu_rows(members, limit, spec.rank)):
        labels = [member_id, str(gpu)]
        for fam, value in zip(fams, row, strict=True):
            fam.add_metric(labels, float(value))
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            yield_gil()


def _add_counts(fam: Family, items: Sequence[tuple[tuple[str, ...] | str, int]]) -> None:
    for labels, n in sorted(items):
        fam.add_metric([labels] if isinstance(labels, str) else list(labels), float(n))


class TableCollector(Collector):
    """Per-GPU (bounded) and per-member figures, imbalance and counters of one table,
    from its published snapshot only (in the scrape thread)."""

    def __init__(self, spec: TableMetrics) -> None:
        self._spec = spec
        self._source: weakref.ReferenceType[SnapshotSource] | None = None

    def set_source(self, source: SnapshotSource) -> None:
        """Feed the families from ``source`` (the table's publisher; held weakly)."""
        self._source = weakref.ref(source)

    def describe(self) -> Iterator[Metric]:
        yield from (s.build() for s in self._spec.specs())

    def collect(self) -> Iterator[Metric]:
        spec = self._spec
        fams = {s.name: s.build() for s in spec.specs()}
        source = self._source() if self._source is not None else None
        if source is not None:
            self._fill(source.fresh(), fams)
        yield from fams.values()

    def _fill(self, snap: TableSnapshot, fams: dict[str, Family]) -> None:
        spec = self._spec
        members = sorted(snap.members, key=lambda m: m.member_id)
        _add_per_member(members, [fams[s.name] for s in spec.per_member])
        n_gpus = sum(int(m.values[0].shape[0]) for m in members)
        fams[spec.gpus.name].add_metric([], float(n_gpus))
        _add_per_gpu(members, spec, snap.gpu_series, [fams[s.name] for s in spec.per_gpu])
        imbalance = fams[spec.imbalance.name]
        for which, dimension in enumerate(spec.dimensions or ("",)):
            value = imbalance_of([m.values[which] for m in members])
            imbalance.add_metric([snap.policy, dimension] if dimension else [snap.policy], value)
        fams[spec.held.name].add_metric([], float(snap.held))
        _add_counts(fams[spec.placements.name], snap.placements)
        for unit_spec, (_, items) in zip(spec.units, snap.units, strict=True):
            _add_counts(fams[unit_spec.name], items)
        _add_counts(fams[spec.releases.name], snap.releases)


def table_collector(spec: TableMetrics) -> TableCollector:
    """A collector of ``spec``, registered on :data:`fulcrum.metrics.REGISTRY`."""
    collector = TableCollector(spec)
    REGISTRY.register(collector)
    return collector


def loss_counters(what: str, expired: str, lost: str, lost_doc: str) -> tuple[Counter, Counter]:
    """The two counters a table increments itself: ``fulcrum_<what>_expirations``
    (placements whose lease ran out; help ``expired``) and ``lost`` (placements lost with
    a member that left, by reason: deregistered, lapsed, replaced; help ``lost_doc``)."""
    return (
        Counter(f"fulcrum_{what}_expirations", expired, registry=REGISTRY),
        Counter(lost, lost_doc, ["reason"], registry=REGISTRY),
    )
