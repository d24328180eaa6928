"""One engine pull as a loop over named steps (see :meth:`PrefillBalancer.take`).

For each candidate request, head first (``candidates``: the prefix-affinity order when it
applies, else the tier's FIFO queue skipping dead requests), a pull asks in turn:

1. ``within_bound``: work of a longer tier only while it holds a rank no longer than the
   engine's own tier allows (the source rule's helping bound);
2. ``binds``: the binding rule's rank horizon (late binding: the least-loaded rank is
   below it; for held requests too, issue 21);
3. ``fits``: the batch quota (:class:`fulcrum.core.prefill.batch.BatchFill`: remaining
   quota, tier cap, request cap, an idle engine's oversize head alone).

The first refusal ends the batch. The pull keeps its own lists (taken, costs, dead);
nothing is shared with the balancer until it commits them. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from fulcrum.core.prefill.affinity import Affinity
from fulcrum.core.prefill.bands import split_band
from fulcrum.core.prefill.batch import BatchFill
from fulcrum.core.prefill.items import Queued, Taken
from fulcrum.core.prefill.ranks import assign_ranks
from fulcrum.core.prefill.rules.base import RankFill


@dataclass(slots=True)
class Pull:
    """A pull in progress by ``engine_id`` from one tier.

    ``order``: the affinity take order (None: FIFO); ``bound_ns``: the helping bound when
    the tier is longer than the engine's (None: none); ``ranks``: the binding rule's rank
    state; ``batch``: the quota fill; ``aff``: prefix affinity (None: off); ``band``: a
    band pass (the ranks hold the work of this band or higher only): the batch ends at
    the first request of a lower band (None: every band), except that a pass for the
    half band of fair-share precedence looks past up to ``skips`` requests of its own
    priority taken without it; ``band_of``: a request's band on its rank (None: its
    priority); ``bands``: those of the taken requests.
    """

    engine_id: str
    order: list[Queued] | None
    bound_ns: int | None
    ranks: RankFill
    batch: BatchFill
    aff: Affinity | None = None
    band: float | None = None
    band_of: Callable[[Queued], float] | None = None
    skips: int = 0
    taken: list[Queued] = field(default_factory=list)
    bands: list[float] = field(default_factory=list)
    costs: list[int] = field(default_factory=list)
    dead: list[Queued] = field(default_factory=list)

    def candidates(self, queue: Iterable[Queued],
                   alive: Callable[[Queued], bool] | None) -> Iterator[Queued]:
        """The requests in take order; dead ones (``alive`` false) go to :attr:`dead`."""
        if self.order is not None:
            yield from self.order
            return
        for item in queue:
            if alive is not None and not alive(item):
                self.dead.append(item)
                continue
            yield item

    def within_bound(self, cost_ns: int) -> bool:
        """Step 1: the request holds a rank no longer than the helping bound allows."""
        return self.bound_ns is None or cost_ns <= self.bound_ns

    def binds(self, item: Queued) -> bool:
        """Step 2: the binding rule lets the request onto the least-loaded rank."""
        return not self.ranks.full()

    def fits(self, cost_ns: int) -> bool:
        """Step 3: the batch quota takes it."""
        return self.batch.offer(cost_ns)

    def run(self, queue: Iterable[Queued], alive: Callable[[Queued], bool] | None,
            cost_for: Callable[[Queued, str], int]) -> None:
        """Walk the candidates through the steps until the first refusal (``cost_for``:
        the balancer's per-engine cost, ns)."""
        for item in self.candidates(queue, alive):
            band = item.cls.priority if self.band_of is None else self.band_of(item)
            if self.band is not None and band < self.band:
                if item.cls.priority < split_band(self.band)[0] or self.skips <= 0:
                    return
                self.skips -= 1  # its own band's work without precedence: look past it
                continue
            c = cost_for(item, self.engine_id)
            if not (self.within_bound(c) and self.binds(item) and self.fits(c)):
                return
            self.ranks.place(c)
            self.taken.append(item)
            self.costs.append(c)
            self.bands.append(band)
            if self.batch.closed:
                return

    def commit(self, tier: int, loads: Sequence[int], remove: Callable[[str], object],
               now_ns: int | None) -> Taken:
        """Remove (``remove``: the balancer's, by request id) the dead and taken requests,
        place the batch on the engine's ranks (``loads``, ns) and record prefix affinity's
        hits (or a fairness override)."""
        for item in self.dead:
            remove(item.request_id)
        chosen = self.taken
        if not chosen:
            return Taken(tier=tier, dead=tuple(self.dead))
        plan = assign_ranks(loads, self.costs)
        aff = self.aff
        if aff is not None and now_ns is not None and self.order is None:
            aff.overrides += 1  # the head waited past the fairness bound: FIFO
        for it in chosen:
            remove(it.request_id)
            if aff is not None and it.blocks:
                hit = aff.taken(self.engine_id, it.tier, it.blocks)
                aff.hits += int(bool(hit) and self.order is not None)
        return Taken(tier=tier, items=tuple(chosen), ranks=plan.ranks,
                     quota_ns=sum(self.costs), dead=tuple(self.dead),
                     costs_ns=tuple(self.costs), bands=tuple(self.bands))
