"""The engines waiting to pull, kept grouped from one dispatch to the next (issue 21).

A dispatch (:func:`fulcrum.core.prefill.dispatch.pick_puller`) asks every waiting engine
for its source tier, then asks the able ones, in the puller rule's order, whether they
can take. Most waiting engines hold none of what a dispatch reads
(:meth:`SourceView.plain`). Those answer alike per own tier and room (their source
tier), and per offer and load part (whether they can take), and their order does not
change while they wait (a parked pull's offer is fixed). :class:`Waiting` keeps them
grouped by own tier, room and offer key, each group sorted by the puller rule's rank.
A dispatch then costs:

- the engines holding a prefix of what the tier's window reads, each asked alone;
- the other engines holding something the dispatch reads, asked alone only as far as
  the order reaches;
- one source answer per own tier and room;
- per group whose source tier is the dispatch's, one "can it take?" for the engines
  whose load part is 0, and one for each engine whose prices still carry a load (the
  balancer's :class:`~fulcrum.core.prefill.balancer.Busy`: those that pulled lately).

Before, it cost a pass and a sort over every waiting engine. The choice is
:func:`pick_puller`'s over the same offers in place order
(``tests/core/prefill/test_waiting.py``): the same source step
(:class:`~fulcrum.core.prefill.balancer.SourceStep`) and the same puller
choice (:func:`~fulcrum.core.prefill.balancer.choose`). Pure; its shell owns it as it
owns the balancer. It regroups when engines moved or the rules changed
(:attr:`PrefillBalancer.generation`): a pass over the waiting engines then.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from fulcrum.core.prefill.balancer import PrefillBalancer, SourceStep, _affinity_window, choose
from fulcrum.core.prefill.items import Offer
from fulcrum.core.prefill.order import Ranked, offer_key
from fulcrum.core.prefill.rules.base import PullerRule

#: An engine's own tier (-1: none, or unknown), whether it has room (binding rule), and
#: its offer's key (:func:`~fulcrum.core.prefill.order.offer_key`).
Group = tuple[int, bool, tuple[object, ...]]


@dataclass(slots=True)
class _Entry:
    offer: Offer
    group: Group
    ranked: Ranked


class Waiting:
    """Offers of engines waiting to pull, each at a place: any unique values that sort in
    the shell's deterministic order (the daemon: engine id, then parking order)."""

    def __init__(self) -> None:
        self._at: dict[Any, _Entry] = {}
        self._of: dict[str, list[Any]] = {}  # engine id -> its places
        self._groups: dict[Group, list[Ranked]] = {}  # each sorted: rank, then place
        self._generation = -1
        self._puller: PullerRule | None = None

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, place: Hashable) -> bool:
        return place in self._at

    def add(self, bal: PrefillBalancer, place: Hashable, offer: Offer) -> None:
        """``offer`` waits at ``place`` (ValueError when one already does)."""
        if place in self._at:
            raise ValueError(f"place: {place!r} already waits")
        self._sync(bal)
        self._put(place, _Entry(offer, _group(bal, offer),
                                (bal.config.rules.puller.rank(offer), place, offer)))
        self._of.setdefault(offer.engine_id, []).append(place)

    def discard(self, place: Hashable) -> None:
        """The offer at ``place`` no longer waits (nothing when none does)."""
        e = self._at.get(place)
        if e is None:
            return
        self._drop(place, e)
        places = self._of[e.offer.engine_id]
        places.remove(place)
        if not places:
            del self._of[e.offer.engine_id]

    def pick(self, bal: PrefillBalancer, tier: int, now_ns: int | None = None) -> Any:
        """The place of the offer that takes ``tier``'s work now (None: none does):
        :func:`~fulcrum.core.prefill.dispatch.pick_puller`'s choice over these offers."""
        self._sync(bal)
        step = SourceStep(bal, now_ns)
        w = None if now_ns is None else _affinity_window(bal, tier, now_ns)
        held = step.view.holders()  # the engines a dispatch asks alone
        window = frozenset(w.holding()) if w is not None else frozenset()
        near_ids = held | window
        tiers: dict[Any, int] = {}

        def source(place: Any) -> int:  # the source tier of the offer at ``place``
            if place not in tiers:
                got = self._at[place]
                tiers[place] = step.tier(got.offer.engine_id, got.group[0], got.group[1])
            return tiers[place]

        # The window's holders are asked first; the others holding something, in order,
        # only as far as the choice reads (usually a few); the plain ones per group.
        near = [self._at[p].ranked for e in window for p in self._of.get(e, ())
                if source(p) == tier]
        later = sorted(self._at[p].ranked for e in held - window for p in self._of.get(e, ()))
        busy: dict[Group, list[Ranked]] = {}
        for e in bal.busy.busy_at(now_ns) if now_ns is not None else ():
            if e not in near_ids:
                for p in self._of.get(e, ()):
                    busy.setdefault(self._at[p].group, []).append(self._at[p].ranked)
        plain: list[_Able] = []
        for group, members in self._groups.items():
            first = next((r for r in members if r[2].engine_id not in near_ids), None)
            if first is not None and source(first[1]) == tier:  # the group's answer
                plain.append(_Able(members, near_ids, sorted(busy.get(group, ()))))

        def offering(e: str) -> bool:  # one of its offers is able
            return any(source(p) == tier for p in self._of.get(e, ()))

        got = choose(bal, tier, w, near, [(r for r in later if source(r[1]) == tier)],
                     offering, now_ns, plain)
        return None if got is None else got[1]

    def _put(self, place: Hashable, e: _Entry) -> None:
        self._at[place] = e
        bisect.insort(self._groups.setdefault(e.group, []), e.ranked)

    def _drop(self, place: Hashable, e: _Entry) -> None:
        del self._at[place]
        g = self._groups[e.group]
        del g[bisect.bisect_left(g, e.ranked)]
        if not g:
            del self._groups[e.group]

    def _sync(self, bal: PrefillBalancer) -> None:
        """Regroup what changed since the last look: the offers of the engines that moved,
        joined or left (:attr:`PrefillBalancer.moves_log`); every offer when that is not
        known (a rule change, more than the log keeps), each rank too when the puller
        rule changed."""
        puller = bal.config.rules.puller
        missed = bal.generation - self._generation
        if missed == 0 and puller is self._puller:
            return
        log = list(bal.moves_log)[-missed:] if 0 < missed <= len(bal.moves_log) else [None]
        if puller is not self._puller or any(m is None for m in log):
            places: list[Any] = list(self._at)
        else:
            places = [p for m in log for e in m or () for p in self._of.get(e, ())]
        for place in places:
            e = self._at[place]
            group = _group(bal, e.offer)
            ranked = e.ranked if puller is self._puller else (puller.rank(e.offer), place,
                                                              e.offer)
            if group != e.group or ranked is not e.ranked:
                self._drop(place, e)
                self._put(place, _Entry(e.offer, group, ranked))
        self._generation, self._puller = bal.generation, puller


def _group(bal: PrefillBalancer, offer: Offer) -> Group:
    eng = bal.engine(offer.engine_id)
    return ((-1 if eng is None else eng.tier), bal.has_room(offer.rank_loads_ns),
            offer_key(offer))


@dataclass(slots=True)
class _Able:
    """A group whose source tier is the dispatch's (:class:`~fulcrum.core.prefill.order.
    Plain`): ``members`` in key order, less those of engines in ``skip`` (asked alone);
    ``busy``, in key order, those whose engine's load part may not be 0 now
    (:class:`~fulcrum.core.prefill.balancer.Busy`). The others answer alike, so the first
    of them answers for all."""

    members: list[Ranked]
    skip: frozenset[str] | set[str]
    busy: list[Ranked]

    def first(self, ok: Callable[[Ranked], bool]) -> Ranked | None:
        ids = {r[2].engine_id for r in self.busy}
        got = next((r for r in self.members
                    if r[2].engine_id not in self.skip and r[2].engine_id not in ids), None)
        if got is not None and not ok(got):
            got = None
        for r in self.busy:
            if got is not None and r > got:
                break
            if ok(r):
                return r
        return got
