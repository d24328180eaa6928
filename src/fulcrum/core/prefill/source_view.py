"""What every engine's source tier reads of the queue, read once per dispatch.

A dispatch (:func:`fulcrum.core.prefill.dispatch.pick_puller`) asks every waiting engine
which tier it takes from. The answers differ by engine, but what they read of the queue
does not: each tier's head, and under prefix affinity the first ``affinity.scan``
requests of each tier and the first blocks of those. :class:`SourceView` computes each
of these once, so a dispatch over ``E`` engines costs ``E`` cheap checks, not ``E``
walks of every tier's take order (issue 21; BENCHMARKS.md, "one dispatch's source
tiers"). It is valid while the queue does not change: one dispatch, one ``now_ns``.
Pure: it reads the balancer (a :class:`fulcrum.core.prefill.rules.base.TierView`) and
changes nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from fulcrum.core.prefill.items import Queued

if TYPE_CHECKING:
    from fulcrum.core.prefill.affinity import Affinity
    from fulcrum.core.prefill.fair import FairLedger, TierQueue

T = TypeVar("T")


class Queues(Protocol):
    """What the view reads of the balancer (``PrefillBalancer`` satisfies it)."""

    n_tiers: int
    affinity: Affinity | None
    fair: FairLedger

    def head(self, tier: int) -> Queued | None: ...

    def queued(self, tier: int, now_ns: int | None = None) -> Iterator[Queued]: ...

    def tier_queue(self, tier: int) -> TierQueue: ...

    def cost_for(self, item: Queued, engine_id: str) -> int: ...

    def helping_bound_ns(self, tier: int) -> int: ...

    def tier_scale_ns(self, tier: int) -> int: ...


class SourceView:
    """The balancer ``bal`` as the source rules and the held-tier check read it at
    ``now_ns`` (a ``TierView``), each tier's head and first requests read once."""

    __slots__ = ("_bal", "_firsts", "_heads", "_holders", "_now", "_once", "_scans",
                 "affinity", "fair", "n_tiers")

    def __init__(self, bal: Queues, now_ns: int | None) -> None:
        self._bal, self._now = bal, now_ns
        self.n_tiers: int = bal.n_tiers
        self.affinity: Affinity | None = bal.affinity
        self.fair: FairLedger = bal.fair
        self._heads: dict[int, Queued | None] = {}
        self._scans: dict[tuple[int, int], list[Queued]] = {}
        self._firsts: dict[tuple[int, int], frozenset[int]] = {}
        self._once: dict[Hashable, object] = {}
        self._holders: frozenset[str] | None = None

    def head(self, tier: int) -> Queued | None:
        """:meth:`PrefillBalancer.head`, read once."""
        if tier not in self._heads:
            self._heads[tier] = self._bal.head(tier)
        return self._heads[tier]

    def scan(self, tier: int, n: int) -> list[Queued]:
        """The first ``n`` requests of ``tier`` in take order at ``now_ns``
        (:meth:`PrefillBalancer.queued`), read once."""
        key = (tier, n)
        got = self._scans.get(key)
        if got is None:
            it: Iterator[Queued] = self._bal.queued(tier, self._now)
            got = self._scans[key] = list(itertools.islice(it, n))
        return got

    def firsts(self, tier: int, n: int) -> frozenset[int]:
        """The first block hash of each of :meth:`scan`'s requests that has blocks: an
        engine holding none of them holds no prefix of any (prefixes start there)."""
        key = (tier, n)
        got = self._firsts.get(key)
        if got is None:
            got = self._firsts[key] = frozenset(
                it.blocks[0] for it in self.scan(tier, n) if it.blocks)
        return got

    def plain(self, engine_id: str) -> bool:
        """True when ``engine_id`` holds the first block of none of the requests this view
        reads (each tier's head and first ``affinity.scan`` requests; every engine without
        prefix affinity): it prices each of them as every such engine does (at no prefix
        held), so its source tier depends on its tier and room alone. One set look-up
        (the engines holding any of those first blocks, once per view: the index tracks
        who holds each, :meth:`PrefixIndex.holding`)."""
        return engine_id not in self.holders()

    def holders(self) -> frozenset[str]:
        """The engines that are not :meth:`plain` (none without prefix affinity)."""
        if self._holders is None:
            aff = self.affinity
            if aff is None:
                self._holders = frozenset()
                return self._holders
            firsts = frozenset().union(
                *(self.firsts(t, aff.scan) for t in range(self.n_tiers)),
                (h.blocks[0] for t in range(self.n_tiers)
                 if (h := self.head(t)) is not None and h.blocks))
            self._holders = frozenset(itertools.chain.from_iterable(
                aff.index.holding(h) for h in firsts))
        return self._holders

    def once(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, computed once per view under ``key`` (what a source rule reads
        of the queue the same way for every engine)."""
        if key not in self._once:
            self._once[key] = compute()
        return cast(T, self._once[key])

    def tier_queue(self, tier: int) -> TierQueue:
        return self._bal.tier_queue(tier)

    def cost_for(self, item: Queued, engine_id: str) -> int:
        return self._bal.cost_for(item, engine_id)

    def helping_bound_ns(self, tier: int) -> int:
        return self._bal.helping_bound_ns(tier)

    def tier_scale_ns(self, tier: int) -> int:
        return self._bal.tier_scale_ns(tier)
